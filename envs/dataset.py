"""`task.name: dataset`: prompts from the user's own data, loaded with Hugging Face `datasets`.

Sources (`path`): a JSONL / JSON / parquet / CSV file, a directory written by `save_to_disk`, a
directory of data files, or a hub dataset id (read from the local Hugging Face cache when offline;
with no cached copy, one line says what to download). A path that can only be local (`/`, `./`,
`~`, a data file's extension: `looks_local`) and is not there is reported missing, never looked up
on the hub. Files are converted once to Arrow files in the `datasets` cache and memory-mapped, so
a large file is never held in memory: the task keeps only an int64 index per kept row (8 MB per
million rows; docs/tasks.md has the measurement). `rollctl` checks a sample of each file's rows
in seconds before any process starts (envs/dataset_check.py).

Rows:
- the prompt is the `prompt_key` column (text), or the `messages_key` column (a list of
  {"role", "content"} messages) for chat-format rows; the learner renders it with the chat
  template (envs/chat.py), after the `system_prompt` when one is set;
- the answer is the `answer_key` column as text ("" when `answer_key` is null);
- the other columns (or only `extra_keys`) travel with the prompt and reach the reward functions as
  keyword arguments (envs/reward_functions.py);
- every row has a stable id: its `id_key` column, else "<split>-<index in the source>", the same
  in every run and every epoch.

Order: the train rows (after the held-out ones and the long ones are removed) are visited in a
fresh permutation each epoch, drawn from (shuffle_seed or run.seed, epoch), endlessly. Item k of
the stream is therefore a function of k alone, and `train_items(seed, start=k)` jumps straight to
it: the learner's resume of its prompt position (`issued`) is exact and O(1).

Bad rows: every line of a JSON or CSV file is checked before the file is read (UTF-8, at most
`max_row_bytes` long, JSON nested at most 63 levels: deeper nesting crashes the Arrow reader),
then every row of the train and held-out sources when they load, before any is issued
(envs/rows.py): the prompt (text, or chat messages), the answer when the task's reward
functions read it (`expect_answers`; `code` does not), the id. A bad row is one line naming the
source, the line and the column, e.g. `data/train.jsonl:7: no 'question'`; so is an empty file
or one `datasets` cannot read. `on_bad_row: skip` leaves bad rows out instead and logs, once per
source, how many and why.

`max_prompt_tokens`: rows whose rendered prompt is longer are left out of train and held-out sets
(never truncated) and counted in the log at load. This renders and tokenizes every row once.

Held-out set: `eval_path` (another source), else the `eval_split` of the same source, else
`heldout_size` rows drawn from the train split with a fixed seed and kept out of training.

The rows are loaded on first use: generators build this task to score rewards and never load it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rollflash.envs.base import Item
from rollflash.envs.dataset_source import MAX_ROW_BYTES, load_source
from rollflash.envs.rows import ANSWER, ID, MESSAGES, TEXT, find_bad_rows, locate
from rollflash.errors import BadInput

log = logging.getLogger(__name__)

HELDOUT_SEED = 1234  # draws the held-out rows of `heldout_size`; independent of the run's seed
_BATCH = 1024  # rows per batch while measuring prompt lengths


def _label(source: str, split: str) -> str:
    """How a bad row's source is named: the file, or the dataset and its split."""
    return source if Path(source).is_file() else f"{source}[{split}]"


def _plain(value: Any) -> Any:
    """A column value as msgpack types (the prompts stream carries it)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


class DatasetTask:
    """Prompts, answers and reward keywords from a dataset (module docstring)."""

    name = "dataset"

    def __init__(
        self,
        path: str,
        prompt_key: str = "prompt",
        messages_key: str | None = None,
        answer_key: str | None = "answer",
        id_key: str | None = None,
        extra_keys: Sequence[str] | None = None,
        system_prompt: str | None = None,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_path: str | None = None,
        heldout_size: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        max_prompt_tokens: int | None = None,
        cache_dir: str | None = None,
        on_bad_row: str = "error",
        max_row_bytes: int = MAX_ROW_BYTES,
    ) -> None:
        """Keys as in the module docstring; `name`: the dataset's configuration (e.g. "main"
        for gsm8k); `cache_dir`: where `datasets` keeps its Arrow files (None: its default);
        `on_bad_row`: "error" (one line naming the first bad row) or "skip" (leave them out);
        `max_row_bytes`: the longest line a JSON or CSV file may hold."""
        if not isinstance(path, str) or not path:
            raise BadInput("task.params.path: a file, directory or hub dataset id is required")
        if heldout_size < 0 or (heldout_size and (eval_split or eval_path)):
            raise BadInput(
                "task.params.heldout_size: must be >= 0, and 0 with eval_split or eval_path"
            )
        if max_prompt_tokens is not None and max_prompt_tokens <= 0:
            raise BadInput(f"task.params.max_prompt_tokens: must be > 0, got {max_prompt_tokens}")
        if on_bad_row not in ("error", "skip"):
            raise BadInput(f"task.params.on_bad_row: {on_bad_row!r} is not error or skip")
        if (
            isinstance(max_row_bytes, bool)
            or not isinstance(max_row_bytes, int)
            or max_row_bytes <= 0
        ):
            raise BadInput(f"task.params.max_row_bytes: an integer > 0, got {max_row_bytes!r}")
        self.max_row_bytes = max_row_bytes
        self.on_bad_row = on_bad_row
        self.needs_answer = False  # set by the reward functions that score the rows
        self.path, self.source_name, self.split = path, name, split
        self.prompt_key, self.messages_key = prompt_key, messages_key
        self.answer_key, self.id_key = answer_key, id_key
        self.extra_keys = None if extra_keys is None else list(extra_keys)
        self.system_prompt, self.cache_dir = system_prompt, cache_dir
        self.eval_split, self.eval_path, self.heldout_size = eval_split, eval_path, heldout_size
        self.shuffle, self.shuffle_seed = shuffle, shuffle_seed
        self.max_prompt_tokens = max_prompt_tokens
        self.formatter: Any = None
        self.filtered = {"train": 0, "heldout": 0}  # rows left out by max_prompt_tokens
        self._train: Any = None  # (dataset, kept row indices), loaded on first use
        self._heldout: Any = None

    def use_formatter(self, formatter: Any) -> None:
        """Render prompts with `formatter` (envs/chat.py); the learner calls it before use."""
        self.formatter = formatter

    def expect_answers(self, needed: bool) -> None:
        """Whether a row without an answer is bad: the reward functions that score this task
        say whether they read it (envs/reward_functions.py)."""
        self.needs_answer = needed

    # -- loading --------------------------------------------------------------------------------

    def _check_columns(self, ds: Any, where: str) -> list[str]:
        """The extra columns of `ds`, after checking that the configured keys exist."""
        columns = list(ds.column_names)
        prompt = ("messages_key", self.messages_key) if self.messages_key else None
        keys = [prompt or ("prompt_key", self.prompt_key), ("answer_key", self.answer_key)]
        keys.append(("id_key", self.id_key))
        keys += [("extra_keys", k) for k in self.extra_keys or []]
        for param, key in keys:
            if key is not None and key not in columns:
                raise BadInput(
                    f"task.params.{param}: no column {key!r} in {where} "
                    f"(columns: {', '.join(columns)})"
                )
        if self.extra_keys is not None:
            return list(self.extra_keys)
        used = {self.messages_key or self.prompt_key, self.answer_key, self.id_key}
        return [c for c in columns if c not in used]

    def _bad_rows(self, ds: Any, source: str, split: str) -> Any:
        """Boolean mask of the rows of `ds` to leave out as bad (module docstring); raises the
        one line naming the first with on_bad_row: error."""
        label = _label(source, split)
        if len(ds) == 0:
            raise BadInput(f"{label}: no rows")
        columns = [(self.messages_key, MESSAGES) if self.messages_key else (self.prompt_key, TEXT)]
        if self.answer_key is not None and self.needs_answer:
            columns.append((self.answer_key, ANSWER))
        if self.id_key is not None:
            columns.append((self.id_key, ID))
        bad = find_bad_rows(ds, columns)
        if not bad.counts:
            return bad.mask
        where = locate(label, Path(source), bad.first.values())
        if self.on_bad_row == "error":
            problem, row = min(bad.first.items(), key=lambda kv: kv[1])
            raise BadInput(f"{where[row]}: {problem}")
        log.warning(
            "dataset %s: on_bad_row: skip leaves out %d of %d rows: %s",
            label,
            int(bad.mask.sum()),
            len(ds),
            "; ".join(f"{n} {p} (first {where[bad.first[p]]})" for p, n in bad.counts.items()),
        )
        return bad.mask

    def _fits(self, ds: Any, keep: Any) -> Any:
        """Boolean mask of the rows in `keep` whose rendered prompt fits max_prompt_tokens."""
        import numpy as np

        if self.max_prompt_tokens is None:
            return keep.copy()
        if self.formatter is None or self.formatter.tokenizer is None:
            raise BadInput("task.params.max_prompt_tokens: needs the model's tokenizer")
        from rollflash.envs.chat import encode_prompts

        column = self.messages_key or self.prompt_key
        rows = np.flatnonzero(keep)
        lengths = []
        for batch in ds.select(rows).select_columns([column]).iter(batch_size=_BATCH):
            texts = [self.formatter.render(p, self.system_prompt) for p in batch[column]]
            lengths += [len(ids) for ids in encode_prompts(self.formatter.tokenizer, texts)]
        fits = np.zeros(len(ds), dtype=bool)
        fits[rows] = np.asarray(lengths, dtype=np.int64) <= self.max_prompt_tokens
        return fits

    def _kept(self, ds: Any, source: str, split: str) -> tuple[Any, int]:
        """The rows of `ds` that are good and fit, and how many good ones did not fit."""
        good = ~self._bad_rows(ds, source, split)
        fits = self._fits(ds, good)
        return fits, int((good & ~fits).sum())

    def _load(self) -> None:
        import numpy as np

        ds = load_source(
            self.path,
            self.split,
            self.source_name,
            self.cache_dir,
            max_row_bytes=self.max_row_bytes,
        )
        self._extra = self._check_columns(ds, self.path)
        fits, self.filtered["train"] = self._kept(ds, self.path, self.split)
        if self.eval_path or self.eval_split:
            source = self.eval_path or self.path
            key = "task.params.eval_path" if self.eval_path else "task.params.path"
            eval_ds = load_source(source, self.eval_split or "train", self.source_name,
                                  self.cache_dir, key, max_row_bytes=self.max_row_bytes)  # fmt: skip
            self._check_columns(eval_ds, source)
            eval_fits, self.filtered["heldout"] = self._kept(
                eval_ds, source, self.eval_split or "train"
            )
            prefix = "eval" if self.eval_path else self.eval_split
            self._heldout = (eval_ds, np.flatnonzero(eval_fits), prefix)
            train_rows = np.flatnonzero(fits)
        else:
            held = np.random.default_rng(HELDOUT_SEED).permutation(np.flatnonzero(fits))
            held = np.sort(held[: self.heldout_size])
            self.filtered["heldout"] = 0
            fits[held] = False
            self._heldout = (ds, held, self.split)
            train_rows = np.flatnonzero(fits)
        if len(train_rows) == 0:
            raise BadInput(f"task.params.path: no training rows left in {self.path}")
        self._train = (ds, train_rows)
        if any(self.filtered.values()):
            log.warning(
                "dataset: %d train and %d held-out prompts are longer than max_prompt_tokens %d "
                "and are left out",
                self.filtered["train"],
                self.filtered["heldout"],
                self.max_prompt_tokens,
            )
        log.info(
            "dataset %s: %d train rows, %d held-out rows",
            self.path,
            len(train_rows),
            len(self._heldout[1]),
        )

    def _item(self, row: dict[str, Any], index: int, prefix: str) -> Item:
        raw = row[self.messages_key] if self.messages_key else row[self.prompt_key]
        if self.formatter is not None:
            prompt = self.formatter.render(raw, self.system_prompt)
        elif isinstance(raw, str):
            prompt = f"{self.system_prompt}\n\n{raw}" if self.system_prompt else raw
        else:
            raise BadInput("task.params.messages_key: chat rows need the model's chat template")
        answer = None if self.answer_key is None else row[self.answer_key]
        item_id = str(row[self.id_key]) if self.id_key else f"{prefix}-{index:07d}"
        extra = {k: _plain(row.get(k)) for k in self._extra}
        return Item(
            id=item_id, prompt=prompt, answer="" if answer is None else str(answer), extra=extra
        )

    # -- the Task interface ---------------------------------------------------------------------

    def train_items(self, seed: int, start: int = 0) -> Iterator[Item]:
        """Endless epochs of the train rows, each in its own permutation; from item `start` on."""
        import numpy as np

        if self._train is None:
            self._load()
        ds, rows = self._train
        seed = seed if self.shuffle_seed is None else self.shuffle_seed
        epoch, offset = divmod(start, len(rows))
        while True:
            order = (
                np.random.default_rng([seed, epoch]).permutation(len(rows))
                if self.shuffle
                else np.arange(len(rows))
            )
            for j in order[offset:]:
                index = int(rows[j])
                yield self._item(ds[index], index, self.split)
            epoch, offset = epoch + 1, 0

    def heldout_items(self) -> list[Item]:
        """The held-out rows in source order (the learner evaluates the first eval.size)."""
        if self._train is None:
            self._load()
        ds, rows, prefix = self._heldout
        return [self._item(ds[int(i)], int(i), prefix) for i in rows]

    def score(self, item: Item, response: str) -> float:
        raise BadInput(
            "reward.functions: task 'dataset' has no verifier of its own; name one or more "
            "reward functions (e.g. [math])"
        )
