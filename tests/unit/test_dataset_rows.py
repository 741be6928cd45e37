"""Bad rows of a dataset task (envs/dataset.py, envs/rows.py): each one is a single line naming
the file, the line and the column when the rows load, before any is issued; `on_bad_row: skip`
leaves them out and says so once. The tasks are built as the learner builds them
(`task_from_config`, with the run's reward functions, which decide whether answers are needed),
and loaded by `heldout_items()`, which the learner calls at start (learner/build.py)."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest

from rollflash.broker.config.config import config_from_dict
from rollflash.envs import task_from_config

GOOD = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(8)]


def _jsonl(path: Path, rows: list, blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _task(path: Path, tmp_path: Path, functions=("math",), **params):
    cfg = config_from_dict(
        {
            "task": {
                "name": "dataset",
                "params": {"path": str(path), "prompt_key": "question",
                           "cache_dir": str(tmp_path / "cache"), **params},
            },
            "reward": {"functions": list(functions)},
        }
    )  # fmt: skip
    return task_from_config(cfg)


def _error(path: Path, tmp_path: Path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        _task(path, tmp_path, **kw).heldout_items()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_row_without_its_prompt(tmp_path):
    rows = GOOD[:6] + [{"answer": "#### 6"}] + GOOD[7:]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path) == f"{path}:7: no 'question'"
    # a blank line before it moves it to line 8 of the file; `datasets` skips blank lines
    path = _jsonl(tmp_path / "train.jsonl", rows, blank_after=2)
    assert _error(path, tmp_path) == f"{path}:8: no 'question'"


def test_a_row_without_its_answer_when_the_reward_reads_it(tmp_path):
    rows = [dict(r, tests=["assert True"]) for r in GOOD]
    rows[3] = {"question": "q3", "tests": ["assert True"]}
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path) == f"{path}:4: no 'answer'"
    # the code reward reads the row's tests, not its answer: the row is good
    task = _task(path, tmp_path, functions=("code",))
    assert len(task.heldout_items()) == 0 and next(task.train_items(0)).prompt.startswith("q")
    items = list(itertools.islice(task.train_items(0), 8))
    assert {it.answer for it in items if it.id == "train-0000003"} == {""}


def test_wrong_types_and_blank_values(tmp_path):
    rows = list(GOOD)
    rows[2] = {"question": 17, "answer": "#### 2"}  # a number where text is wanted
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path) == f"{path}:3: 'question' is a number, not text"
    rows[2] = {"question": "q2", "answer": ["#### 2"]}
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path) == f"{path}:3: 'answer' is a list, not text or a number"
    rows[2] = {"question": "   ", "answer": "#### 2"}
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path) == f"{path}:3: 'question' is empty"
    rows[2] = {"question": "q2", "answer": 2}  # a number is an answer
    assert len(list(itertools.islice(_task(_jsonl(path, rows), tmp_path).train_items(0), 8))) == 8


def test_an_empty_file_and_one_that_is_not_json(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert _error(empty, tmp_path) == f"{empty}: empty, no rows"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\n{"question": "b", answer: 2}\n')
    message = _error(broken, tmp_path)
    assert message.startswith(f"{broken}:2: not valid JSON (Expecting property name")


def test_a_bad_row_of_the_eval_split(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", GOOD)
    test = _jsonl(tmp_path / "test.jsonl", GOOD[:2] + [{"question": None, "answer": "1"}])
    assert _error(train, tmp_path, eval_path=str(test)) == f"{test}:3: no 'question'"


def test_csv_lines_and_parquet_rows(tmp_path):
    import datasets

    rows = [dict(r) for r in GOOD]
    rows[4]["question"] = None
    ds = datasets.Dataset.from_list(rows)
    csv, parquet = tmp_path / "train.csv", tmp_path / "train.parquet"
    ds.to_csv(str(csv), index=False)
    ds.to_parquet(str(parquet))
    assert _error(csv, tmp_path) == f"{csv}:6: no 'question'"  # line 1 is the header
    assert _error(parquet, tmp_path) == f"{parquet}:5: no 'question'"  # the row's number
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(saved))
    assert _error(saved, tmp_path) == f"{saved}[train]:5: no 'question'"


def test_chat_rows_are_checked_as_messages(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": "1"} for i in range(3)]
    rows[1]["messages"] = [{"role": "user"}]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    message = _error(path, tmp_path, messages_key="messages")
    assert message == f"{path}:2: 'messages' is not a list of {{role, content}} messages"


def test_on_bad_row_skip_leaves_them_out_and_says_so_once(tmp_path, caplog):
    rows = list(GOOD)
    rows[1] = {"answer": "#### 1"}
    rows[5] = {"question": "q5", "answer": {"n": 5}}
    rows[6] = {"answer": "#### 6"}
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match="on_bad_row: 'drop' is not error or skip"):
        _task(path, tmp_path, on_bad_row="drop")
    task = _task(path, tmp_path, on_bad_row="skip", heldout_size=1)
    with caplog.at_level(logging.WARNING, logger="rollflash.envs.dataset"):
        held = task.heldout_items()
        train = list(itertools.islice(task.train_items(0), 10))
    skipped = [r.getMessage() for r in caplog.records if "on_bad_row: skip" in r.getMessage()]
    assert skipped == [
        f"dataset {path}: on_bad_row: skip leaves out 3 of 8 rows: 2 no 'question' (first "
        f"{path}:2); 1 'answer' is a mapping, not text or a number (first {path}:6)"
    ]
    # 8 rows - 3 bad - 1 held out = 4 train rows, none of them bad
    ids = {it.id for it in train}
    assert len(held) == 1 and len(ids) == 4
    assert not ids & {"train-0000001", "train-0000005", "train-0000006"}


def _lines(path: Path, *rows: bytes) -> Path:
    path.write_bytes(b"".join(row + b"\n" for row in rows))
    return path


def test_rows_no_reader_survives_are_refused_before_it_reads_them(tmp_path):
    """20,000 nested lists crash the Arrow JSON reader (SIGSEGV, nothing said), invalid UTF-8
    reaches it as a raw error, and a 100 MB row is read whole: each is one line naming the
    file and the line, before the reader starts."""
    good = [json.dumps(r).encode() for r in GOOD[:4]]
    deep = b'{"question": "q", "answer": "1", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    path = _lines(tmp_path / "deep.jsonl", *good, deep)
    assert _error(path, tmp_path) == f"{path}:5: JSON nested deeper than 63 levels"
    # the row's object and 62 lists: 63 levels, the most Arrow holds; brackets in strings are text
    fine = {"question": "[" * 300, "answer": "1", "x": json.loads("[" * 62 + "]" * 62)}
    path = _jsonl(tmp_path / "fine.jsonl", [*GOOD[:4], fine])
    assert len(_task(path, tmp_path).heldout_items()) == 0
    fine["x"] = [fine["x"]]  # 64 levels
    path = _jsonl(tmp_path / "one_more.jsonl", [*GOOD[:4], fine])
    assert _error(path, tmp_path) == f"{path}:5: JSON nested deeper than 63 levels"
    path = _lines(tmp_path / "utf8.jsonl", *good[:2], b'{"question": "q\xff", "answer": "1"}')
    assert _error(path, tmp_path) == f"{path}:3: not valid UTF-8 (byte 0xff at column 16)"
    big = json.dumps({"question": "q" * (100 << 20), "answer": "1"}).encode()
    path = _lines(tmp_path / "big.jsonl", *good, big, *good)
    assert _error(path, tmp_path) == (
        f"{path}:5: a row longer than 16777216 bytes (task.params.max_row_bytes)"
    )


def test_max_row_bytes_sets_the_longest_row(tmp_path):
    rows = [dict(r) for r in GOOD]
    rows[2]["question"] = "q" * 200
    size = len(json.dumps(rows[2]))  # line 3's bytes, its newline not counted: 236
    path = _jsonl(tmp_path / "train.jsonl", rows)
    assert _error(path, tmp_path, max_row_bytes=size - 1) == (
        f"{path}:3: a row longer than {size - 1} bytes (task.params.max_row_bytes)"
    )
    task = _task(path, tmp_path, max_row_bytes=size)
    assert len(list(itertools.islice(task.train_items(0), 8))) == 8
    with pytest.raises(ValueError, match=r"max_row_bytes: an integer > 0, got 0"):
        _task(path, tmp_path, max_row_bytes=0)


def test_a_json_list_is_measured_across_lines_and_csv_is_checked_too(tmp_path):
    # one list, pretty-printed, one level per line: its nesting carries from line to line, and
    # the list's own level is not a row's
    rows = [{"question": "q", "answer": "1", "x": json.loads("[" * 62 + "]" * 62)}] * 2
    listed = tmp_path / "train.json"
    listed.write_text(json.dumps(rows, indent=1))
    assert len(_task(listed, tmp_path).heldout_items()) == 0
    rows[1] = {"question": "q", "answer": "1", "x": json.loads("[" * 70 + "]" * 70)}
    listed.write_text(json.dumps(rows, indent=1))
    # line 1 "["; row 1 is lines 2-128 ("{", 3 keys, 60 more opening lines, the innermost
    # "[]", 61 closing lines, "},"); row 2's "{" is line 129 at level 1 (the list's own level is
    # not a row's) and its '"x": [' line 132 at level 2, so level 64 is line 132 + 62
    message = _error(listed, tmp_path)
    assert message == f"{listed}:{132 + 62}: JSON nested deeper than 63 levels"
    table = _lines(tmp_path / "train.csv", b"question,answer", b"q1,1", b"q\xc3(,2")
    assert _error(table, tmp_path) == f"{table}:3: not valid UTF-8 (byte 0xc3 at column 2)"
    folder = tmp_path / "folder"
    folder.mkdir()
    _lines(folder / "part-0.jsonl", *[json.dumps(r).encode() for r in GOOD], b"[" * 500)
    part = folder / "part-0.jsonl"
    assert _error(folder, tmp_path) == f"{part}:9: JSON nested deeper than 63 levels"
