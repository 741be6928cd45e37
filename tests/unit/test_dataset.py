"""task.name: dataset (envs/dataset.py): every source format, stable ids, extra columns, exact
resume of the prompt position, the prompt-length filter, held-out sets and the offline hub error."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflash.envs import Item, make_task, train_stream
from rollflash.envs.chat import PromptFormatter
from rollflash.envs.dataset import DatasetTask

ROWS = [
    {"question": f"q{i} " + "x" * (i % 5), "answer": f"#### {i}", "level": i % 3} for i in range(20)
]


def _write(tmp_path: Path, fmt: str) -> Path:
    """ROWS as a file of `fmt`, or a save_to_disk directory."""
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        path = tmp_path / "rows.parquet"
        ds.to_parquet(str(path))
    elif fmt == "csv":
        path = tmp_path / "rows.csv"
        ds.to_csv(str(path), index=False)
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(path))
    return path


def _task(path: Path, tmp_path: Path, **params) -> DatasetTask:
    return make_task(
        "dataset",
        {"path": str(path), "prompt_key": "question", "cache_dir": str(tmp_path / "c"), **params},
    )


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "save_to_disk"])
def test_every_source_format_yields_the_same_rows(tmp_path, fmt):
    task = _task(_write(tmp_path, fmt), tmp_path, shuffle=False)
    items = list(itertools.islice(task.train_items(seed=0), 20))
    # no shuffle: source order; ids are the source index; level is an extra column
    assert [it.id for it in items] == [f"train-{i:07d}" for i in range(20)]
    assert items[7] == Item(id="train-0000007", prompt="q7 xx", answer="#### 7", extra={"level": 1})


def test_save_to_disk_splits_and_eval_split(tmp_path):
    task = _task(_write(tmp_path, "save_to_disk"), tmp_path, eval_split="test")
    held = task.heldout_items()
    assert [it.id for it in held] == ["test-0000000", "test-0000001", "test-0000002"]
    with pytest.raises(
        ValueError, match=r"task.params.split: .* has no split 'dev' \(splits: train, test\)"
    ):
        list(itertools.islice(_task(tmp_path / "saved", tmp_path, split="dev").train_items(0), 1))


def test_ids_are_stable_across_runs_epochs_and_seeds(tmp_path):
    path = _write(tmp_path, "jsonl")
    a = list(itertools.islice(_task(path, tmp_path).train_items(seed=3), 45))
    b = list(itertools.islice(_task(path, tmp_path).train_items(seed=3), 45))
    c = list(itertools.islice(_task(path, tmp_path).train_items(seed=4), 20))
    assert a == b  # same seed, same stream
    # each epoch of 20 rows is a permutation: every id exactly once
    assert sorted(it.id for it in a[:20]) == sorted(it.id for it in a[20:40])
    assert len({it.id for it in a[:20]}) == 20
    assert [it.id for it in c] != [it.id for it in a[:20]]  # another seed, another order
    by_id = {it.id: it for it in a + c}
    assert by_id["train-0000011"].prompt == "q11 x"  # an id always names the same row


def test_id_key_column_names_the_rows(tmp_path):
    rows = [{"uid": f"u{i}", "prompt": f"p{i}", "answer": str(i)} for i in range(4)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("dataset", {"path": str(path), "id_key": "uid", "shuffle": False})
    items = list(itertools.islice(task.train_items(0), 4))
    assert [it.id for it in items] == ["u0", "u1", "u2", "u3"] and items[0].extra == {}


@pytest.mark.parametrize("start", [0, 1, 19, 20, 33, 57])
def test_resume_at_any_position_is_exact(tmp_path, start):
    path = _write(tmp_path, "jsonl")
    full = list(itertools.islice(_task(path, tmp_path).train_items(seed=1), 70))
    resumed = list(itertools.islice(train_stream(_task(path, tmp_path), 1, start), 70 - start))
    assert resumed == full[start:]


def test_heldout_size_rows_never_reach_training(tmp_path):
    task = _task(_write(tmp_path, "jsonl"), tmp_path, heldout_size=5)
    held = {it.id for it in task.heldout_items()}
    train = {it.id for it in itertools.islice(task.train_items(0), 45)}
    assert len(held) == 5 and len(train) == 15 and not held & train


def test_long_prompts_are_filtered_and_counted_never_truncated(tmp_path):
    class CharTokenizer:  # one id per character, no special tokens
        bos_token_id = None
        chat_template = None

        def __call__(self, texts):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    task = _task(_write(tmp_path, "jsonl"), tmp_path, max_prompt_tokens=5, system_prompt=None)
    task.use_formatter(PromptFormatter(CharTokenizer(), "auto"))
    items = list(itertools.islice(task.train_items(0), 40))
    # "q{i} " + "x" * (i % 5): length 3 + i % 5 for i < 10, 4 + i % 5 for i >= 10;
    # <= 5 tokens: i in {0,1,2,5,6,7} (3,4,5) and {10,11,15,16} (4,5) -> 10 rows kept, 10 filtered
    kept = {int(it.id.split("-")[1]) for it in items}
    assert kept == {0, 1, 2, 5, 6, 7, 10, 11, 15, 16}
    assert task.filtered == {"train": 10, "heldout": 0}
    assert all(len(it.prompt) <= 5 for it in items)


def test_system_prompt_without_template_and_messages_rows(tmp_path):
    path = _write(tmp_path, "jsonl")
    task = _task(path, tmp_path, system_prompt="Solve it.", shuffle=False)
    assert next(task.train_items(0)).prompt == "Solve it.\n\nq0 "
    rows = [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(rows[0]) + "\n")
    task = make_task("dataset", {"path": str(chat), "messages_key": "messages"})
    with pytest.raises(ValueError, match="chat rows need the model's chat template"):
        next(task.train_items(0))


def test_missing_columns_and_bad_files_name_the_key(tmp_path):
    path = _write(tmp_path, "jsonl")
    with pytest.raises(ValueError) as e:
        next(_task(path, tmp_path, answer_key="solution").train_items(0))
    assert str(e.value) == (
        f"task.params.answer_key: no column 'solution' in {path} (columns: question, answer, level)"
    )
    bad = tmp_path / "rows.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="is not .jsonl, .json, .parquet or .csv"):
        next(make_task("dataset", {"path": str(bad)}).train_items(0))


def test_an_uncached_hub_id_offline_says_what_to_download(tmp_path):
    code = (
        "from rollflash.envs import make_task\n"
        "t = make_task('dataset', {'path': 'someone/no-such-set'})\n"
        "try:\n    t.heldout_items()\nexcept ValueError as e:\n    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    line = out.stdout.strip()
    assert "\n" not in line
    assert line.startswith("task.params.path: 'someone/no-such-set' is not a local file or")
    assert "datasets.load_dataset('someone/no-such-set')" in line


def test_generators_never_load_the_rows(tmp_path):
    task = make_task("dataset", {"path": str(tmp_path / "absent.jsonl")})
    assert task._train is None  # building the task (as a generator does) reads nothing


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parents[2].glob("configs/*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_config_builds_its_task(path):
    """Beyond loading (tests/unit/test_config.py): task params are the constructor's, and the
    reward functions import. A dataset task reads no rows here (gsm8k_qwen.yaml needs the hub)."""
    from rollflash.broker.config.config import load_config
    from rollflash.envs import task_from_config

    cfg = load_config(path)
    task = task_from_config(cfg)
    assert task.name == cfg.task.name
