"""`task.name: reasoning_gym`: procedurally generated reasoning tasks from the `reasoning-gym`
package (`pip install 'rollflash[reasoning-gym]'`), scored by each dataset's own `score_answer`.

    task:
      name: reasoning_gym
      params:
        datasets:
          chain_sum: {weight: 2, config: {min_terms: 2, max_terms: 3}}
          countdown: {weight: 1, max_new_tokens: 256}
        size: 10000          # train items per dataset (reasoning-gym's `size`)
        seed: 0              # reasoning-gym's `seed`: which problems; the run seed orders them
        heldout_size: 100    # held-out items per dataset

Each dataset is one domain of a mixture (envs/mixture.py), even when there is only one: item ids
are "<dataset>/train-0000012", the learner logs `reward/<dataset>/mean` per step and
`eval/<dataset>/heldout_acc` per evaluation. A dataset's `config` is its reasoning-gym config
dataclass's fields (an unknown field is an error that lists them), `weight` its share of the
prompts (normalised) and `max_new_tokens` its response limit (default: rollout.max_new_tokens).

Problems: dataset `d` with generation seed S holds `size` train problems, `d[0] .. d[size - 1]`;
reasoning-gym makes problem i from Random(S + i) (or, for a few datasets, draws all `size` from
Random(S)). The held-out problems come from a second instance with seed S + size, so their seeds
S + size .. S + size + heldout_size - 1 are outside the train range. Disjoint seeds do not make
distinct questions in a small problem space (two one-digit sums repeat quickly), so the learner
also generates every train problem once when it first loads the task, and leaves out of training
each one whose question is a held-out question (counted in the log). The train stream visits the
remaining problems in a fresh permutation per epoch drawn from (run seed, epoch): item k depends on
k alone, and a resumed learner continues exactly (`train_items(seed, start=k)`).

Reward, for a response r (EOS stripped):

    extracted = reasoning_gym.utils.extract_answer(r, tag_name=answer_tag)   # last <answer>...</answer>
    reward    = dataset.score_answer(extracted, entry) + format_reward * (extracted is not None)

the extraction every reasoning-gym dataset documents: its default system prompt asks for the
final answer inside <answer> </answer> tags, `extract_answer` takes the last such span (stripped)
and `score_answer` compares it with the entry (1.0 right; some datasets give partial credit). With
`answer_tag: null` the whole response, stripped, is the answer. The generators do not receive the
entry over the wire: they regenerate it from the item id (the same dataset, seed and index) and
refuse an item whose regenerated answer differs (a learner and a generator with different
reasoning-gym releases). An exception in `score_answer` scores 0 with the counted reason
`function_error`.

Prompts: the dataset's question, after `system_prompt` (a name of reasoning-gym's SYSTEM_PROMPTS,
"default" by default, or literal text; null: none), rendered with the model's chat template as the
dataset task's prompts are (envs/chat.py).

reasoning-gym is imported when the task is built, so envs/ stays importable without it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from rollflash.envs.base import Item
from rollflash.envs.mixture import Component, MixtureTask
from rollflash.envs.scored import Scored

log = logging.getLogger(__name__)

_SPEC_KEYS = {"weight", "config", "max_new_tokens"}
_OWN_KEYS = {"seed", "size"}  # set by the task, not per dataset
_CACHE = 4096  # regenerated entries kept per dataset (a group's samples share one)


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "task reasoning_gym: the reasoning-gym package is not installed; "
            "pip install 'rollflash[reasoning-gym]'"
        ) from None
    return reasoning_gym


def _config_fields(rg: Any, name: str, config: dict[str, Any], where: str) -> dict[str, Any]:
    """`config` checked against the dataset's config dataclass (and its own `validate`)."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = [d for d in sorted(DATASETS) if d[:3] == name[:3]]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"{where}: reasoning-gym has no dataset {name!r}{hint}")
    if not isinstance(config, dict):
        raise ValueError(f"{where}.config: expected a mapping, got {config!r}")
    fields = {f.name for f in dataclasses.fields(DATASETS[name][1])} - _OWN_KEYS
    for key in config:
        if key in _OWN_KEYS:
            raise ValueError(f"{where}.config.{key}: set task.params.{key} instead")
        if key not in fields:
            raise ValueError(
                f"{where}.config: unknown key {key!r} for {name}; accepted: "
                f"{', '.join(sorted(fields))}"
            )
    try:
        rg.create_dataset(name, seed=0, size=1, **config)
    except Exception as e:  # the dataset's own validation (assertions)
        raise ValueError(f"{where}.config: {name} refuses it ({type(e).__name__}: {e})") from None
    return dict(config)


class ReasoningGymDataset:
    """One reasoning-gym dataset as a single-turn task (module docstring)."""

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any],
        size: int,
        seed: int,
        heldout_size: int,
        system_prompt: str | None,
        answer_tag: str | None,
        format_reward: float,
    ) -> None:
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.rg = _import()
        self.name = dataset
        self.config, self.size, self.seed, self.heldout_size = config, size, seed, heldout_size
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt or "", system_prompt)
        self.answer_tag, self.format_reward = answer_tag, format_reward
        self._extract = extract_answer
        self.formatter: Any = None
        self.repeats = 0  # train problems left out: their question is a held-out question
        self._train_rows: list[int] | None = None  # kept train indices, set on first use
        self.entry = functools.lru_cache(_CACHE)(self._entry)

    @functools.cached_property
    def _datasets(self) -> dict[str, Any]:
        """The train and held-out instances (built on first use: some datasets draw every
        problem in their constructor)."""
        make = functools.partial(self.rg.create_dataset, self.name, **self.config)
        return {
            "train": make(seed=self.seed, size=self.size),
            "heldout": make(seed=self.seed + self.size, size=self.heldout_size),
        }

    def _entry(self, split: str, index: int) -> dict[str, Any]:
        return self._datasets[split][index]

    def use_formatter(self, formatter: Any) -> None:
        """Render prompts with `formatter` (envs/chat.py); the learner calls it before use."""
        self.formatter = formatter

    def _item(self, split: str, index: int) -> Item:
        entry = self.entry(split, index)
        question = entry["question"]
        if self.formatter is not None:
            prompt = self.formatter.render(question, self.system_prompt)
        else:
            prompt = f"{self.system_prompt}\n\n{question}" if self.system_prompt else question
        return Item(id=f"{split}-{index:07d}", prompt=prompt, answer=str(entry["answer"]))

    def _kept_train_rows(self) -> list[int]:
        """Train indices whose question is not a held-out question (module docstring)."""
        if self._train_rows is None:
            started = time.monotonic()
            held = {self.entry("heldout", j)["question"] for j in range(self.heldout_size)}
            train = self._datasets["train"]
            self._train_rows = [i for i in range(self.size) if train[i]["question"] not in held]
            self.repeats = self.size - len(self._train_rows)
            log.info(
                "reasoning_gym %s: %d train problems (%d left out: a held-out question), "
                "checked in %.1fs",
                self.name,
                len(self._train_rows),
                self.repeats,
                time.monotonic() - started,
            )
            if not self._train_rows:
                raise ValueError(
                    f"task.params.datasets.{self.name}: every train problem repeats a held-out "
                    "question; raise size or lower heldout_size"
                )
        return self._train_rows

    def train_items(self, seed: int, start: int = 0) -> Iterator[Item]:
        """Endless epochs of the kept train problems, each epoch in its own permutation drawn
        from (seed, epoch); from item `start` on."""
        import random

        rows = self._kept_train_rows()
        epoch, offset = divmod(start, len(rows))
        while True:
            order = list(rows)
            random.Random(f"rg-{seed}-{epoch}").shuffle(order)
            for index in order[offset:]:
                yield self._item("train", index)
            epoch, offset = epoch + 1, 0

    def heldout_items(self) -> list[Item]:
        return [self._item("heldout", j) for j in range(self.heldout_size)]

    def final_answer(self, item_id: str, response: str) -> str:
        """What `score` hands to score_answer (envs/answers.py): the last answer-tag span, ""
        when there is none, or the stripped response with `answer_tag: null`."""
        if self.answer_tag is None:
            return response.strip()
        return self._extract(response, tag_name=self.answer_tag) or ""

    def reference_response(self, item: Item) -> str:
        """The answer inside the answer tags (envs/answers.py)."""
        tag = self.answer_tag
        return item.answer if tag is None else f"<{tag}>{item.answer}</{tag}>"

    def score(self, item: Item, response: str) -> float:
        split, _, index = item.id.partition("-")
        if split not in ("train", "heldout") or not index.isdigit():
            raise ValueError(f"reasoning_gym {self.name}: {item.id!r} is not one of its items")
        entry = self.entry(split, int(index))
        if str(entry["answer"]) != item.answer:
            raise ValueError(
                f"reasoning_gym {self.name}: item {item.id} regenerates with another answer "
                f"({str(entry['answer'])!r:.40} vs {item.answer!r:.40}): the learner and this "
                "process run different reasoning-gym releases or task params"
            )
        if self.answer_tag is None:
            extracted: str | None = response.strip()
        else:
            extracted = self._extract(response, tag_name=self.answer_tag)
        try:
            value = float(self._datasets[split].score_answer(extracted, entry))
        except Exception as e:
            log.warning("reasoning_gym %s: score_answer raised %r", self.name, e)
            return Scored(0.0, "function_error")
        return value + self.format_reward * (extracted is not None)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"task.params.{name}: must be a positive integer, got {value!r}")
    return value


def reasoning_gym_task(
    datasets: dict[str, Any],
    size: int = 10_000,
    seed: int = 0,
    heldout_size: int = 100,
    system_prompt: str | None = "default",
    answer_tag: str | None = "answer",
    format_reward: float = 0.0,
) -> MixtureTask:
    """The task of the module docstring: one mixture domain per dataset of `datasets`
    ({name: {weight, config, max_new_tokens}})."""
    rg = _import()
    if not isinstance(datasets, dict) or not datasets:
        raise ValueError("task.params.datasets: a non-empty mapping of reasoning-gym datasets")
    _positive("size", size), _positive("heldout_size", heldout_size)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"task.params.seed: must be an integer >= 0, got {seed!r}")
    if (
        isinstance(format_reward, bool)
        or not isinstance(format_reward, (int, float))
        or not math.isfinite(format_reward)
    ):
        raise ValueError(
            f"task.params.format_reward: must be a finite number, got {format_reward!r}"
        )
    components = []
    for name, spec in datasets.items():
        where = f"task.params.datasets.{name}"
        spec = {} if spec is None else spec
        unknown = sorted(set(spec) - _SPEC_KEYS) if isinstance(spec, dict) else ["(not a map)"]
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; accepted: weight, config, "
                             "max_new_tokens")  # fmt: skip
        config = _config_fields(rg, name, spec.get("config") or {}, where)
        task = ReasoningGymDataset(
            name, config, size, seed, heldout_size, system_prompt, answer_tag, float(format_reward)
        )
        component = {"name": name, "weight": spec.get("weight", 1.0)}
        if "max_new_tokens" in spec:
            component["max_new_tokens"] = spec["max_new_tokens"]
        components.append(Component.checked(where, component, task))
    mixture = MixtureTask(components)
    mixture.name = "reasoning_gym"
    return mixture
