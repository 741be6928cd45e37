"""envs/dataset_check.py: a dataset's files checked on a sample of rows in seconds, before any
process starts, with the lines the learner's full check would print."""

from __future__ import annotations

import json
import re

import pytest

from rollflash.envs.dataset import DatasetTask
from rollflash.envs.dataset_check import SAMPLE, check_dataset
from rollflash.envs.dataset_source import looks_local
from rollflash.errors import BadInput, MissingFile


def _task(path, needs_answer: bool = True, **params) -> DatasetTask:
    task = DatasetTask(str(path), prompt_key="question", answer_key="answer", **params)
    task.expect_answers(needs_answer)
    return task


def _jsonl(path, rows) -> None:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))


def _good(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(start, start + n)]


def test_a_good_file_passes_and_the_learner_agrees(tmp_path):
    path = tmp_path / "train.jsonl"
    _jsonl(path, _good(500))
    task = _task(path)
    check_dataset(task)
    assert len(task.heldout_items()) == 0 and next(task.train_items(0)).prompt.endswith("+1=")


def test_a_bad_row_among_the_first_is_named_as_the_learner_names_it(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = _good(12)
    rows[6] = {"answer": "7"}
    _jsonl(path, rows)
    with pytest.raises(BadInput) as quick:
        check_dataset(_task(path))
    with pytest.raises(BadInput) as full:  # the learner's check of every row (datasets)
        _task(path).heldout_items()
    assert str(quick.value) == str(full.value) == f"{path}:7: no 'question'"


def test_a_bad_block_far_into_a_large_file_is_found_with_its_line(tmp_path):
    # 4000 rows, rows 2400..2799 (10% of the file) bad: the 32 offsets spread over the rest
    # are 1/32 (~3%) of the file apart, so at least three of them land in the block
    path = tmp_path / "train.jsonl"
    rows = _good(4000)
    for i in range(2400, 2800):
        rows[i] = {"question": "", "answer": "1"}
    _jsonl(path, rows)
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    found = re.fullmatch(rf"{re.escape(str(path))}:(\d+): 'question' is empty", str(e.value))
    assert found, str(e.value)
    line = int(found.group(1))
    assert 2401 <= line <= 2800  # rows are lines 1..4000
    assert json.loads(path.read_text().splitlines()[line - 1])["question"] == ""


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"question": "1+1=", "answer": \n', "not valid JSON (Expecting value"),
        ("[1, 2]\n", "not a JSON object"),
        # the learner's own line checks come first (envs/rows.py), with the learner's words
        ("[" * 100_000 + "]" * 100_000 + "\n", "JSON nested deeper than 63 levels"),
    ],
)
def test_a_line_that_is_not_a_json_object_is_named(tmp_path, line, expected):
    path = tmp_path / "train.jsonl"
    _jsonl(path, [*_good(2), line, *_good(3)])
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    assert str(e.value).startswith(f"{path}:3: {expected}")


def test_bad_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "1+1=", "answer": "2"}\n{"question": "\xff", "answer": "1"}\n')
    with pytest.raises(BadInput, match=rf"^{re.escape(str(path))}:2: not valid UTF-8 "):
        check_dataset(_task(path))


def test_a_missing_column_names_the_parameter_and_the_file(tmp_path):
    path = tmp_path / "train.jsonl"
    _jsonl(path, [{"q": "1+1=", "answer": "2"}] * 3)
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    assert str(e.value) == (
        f"task.params.prompt_key: no column 'question' in {path} (columns: answer, q)"
    )


def test_an_empty_file_and_an_unknown_extension(tmp_path):
    empty, text = tmp_path / "empty.jsonl", tmp_path / "train.txt"
    empty.write_text("\n  \n")
    text.write_text("1+1=\n")
    with pytest.raises(BadInput, match=rf"^task.params.path: {re.escape(str(empty))} is empty"):
        check_dataset(_task(empty))
    with pytest.raises(BadInput, match="is not .jsonl, .json, .parquet or .csv"):
        check_dataset(_task(text))


def test_a_missing_local_file_is_missing_and_a_hub_id_is_left_to_the_learner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingFile) as e:
        check_dataset(_task("nothere.jsonl"))
    assert str(e.value) == "task.params.path: no such file or directory: nothere.jsonl"
    good = tmp_path / "train.jsonl"
    _jsonl(good, _good(3))
    with pytest.raises(MissingFile, match="^task.params.eval_path: no such file or directory"):
        check_dataset(_task(good, eval_path="./data/test.jsonl"))
    check_dataset(_task("openai/gsm8k"))  # a hub id: the learner reads the local cache
    assert looks_local("/x") and looks_local("./x") and looks_local("~/x")
    assert looks_local("x.jsonl") and looks_local("d/x.PARQUET") and looks_local("x.csv")
    assert not looks_local("openai/gsm8k") and not looks_local("gsm8k")


def test_the_load_of_a_missing_local_file_never_asks_the_hub(tmp_path, monkeypatch):
    import datasets

    from rollflash.envs.dataset_source import load_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub asked"))
    with pytest.raises(MissingFile, match="^task.params.path: no such file or directory"):
        load_source("nothere.jsonl", "train")


def test_csv_rows_and_header(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("question,answer\n1+1=,2\n,3\n")
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    with pytest.raises(BadInput) as full:  # the learner's check of every row (datasets)
        _task(path).heldout_items()
    assert str(e.value) == str(full.value) == f"{path}:3: no 'question'"
    path.write_text("q,answer\n1+1=,2\n")
    with pytest.raises(BadInput, match="^task.params.prompt_key: no column 'question'"):
        check_dataset(_task(path))


def test_parquet_schema_rows_and_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1=", None], "answer": ["2", "3"]}), path)
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    with pytest.raises(BadInput) as full:  # the learner's check of every row (datasets)
        _task(path).heldout_items()
    assert str(e.value) == str(full.value) == f"{path}:2: no 'question'"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": []}), path)
    with pytest.raises(BadInput, match="has no rows"):
        check_dataset(_task(path))


def test_a_json_list_is_sampled_by_row(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([*_good(3), 5]))
    with pytest.raises(BadInput) as e:
        check_dataset(_task(path))
    assert str(e.value) == f"{path}:4: not a JSON object"


def test_what_the_task_does_not_check_is_not_checked(tmp_path):
    path = tmp_path / "train.jsonl"
    _jsonl(path, [*_good(2), {"question": "3+1="}, {"question": "", "answer": "1"}])
    check_dataset(_task(path, on_bad_row="skip"))  # bad rows are left out at load
    _jsonl(path, [*_good(2), {"question": "3+1="}])
    check_dataset(_task(path, needs_answer=False))  # no reward function reads the answer
    _jsonl(path, [*_good(2), "{not json\n"])
    with pytest.raises(BadInput, match="not valid JSON"):  # no reader skips that
        check_dataset(_task(path, on_bad_row="skip"))


def test_reading_is_bounded(tmp_path, monkeypatch):
    """2 x SAMPLE lines of a JSON-lines file are parsed whatever its size."""
    import rollflash.envs.dataset_check as dc

    path = tmp_path / "train.jsonl"
    _jsonl(path, _good(20_000))
    parsed = []
    real = dc._parse
    monkeypatch.setattr(dc, "_parse", lambda raw, *a: parsed.append(raw) or real(raw, *a))
    check_dataset(_task(path))
    assert SAMPLE < len(parsed) <= 2 * SAMPLE
