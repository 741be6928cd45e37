"""Checking a dataset task's files in seconds, before any process of a run starts (`rollctl`'s
preflight, rollctl/preflight.py); the learner still checks every row when it loads them
(envs/dataset.py, envs/rows.py).

For each source of a `DatasetTask` (`path`, and `eval_path`):
- a path that can only be local (envs/dataset.py `looks_local`) must exist; a hub dataset id, or a
  directory (`save_to_disk`, or data files), is left to the learner;
- a file must have a data extension (.jsonl, .json, .parquet, .csv) and not be empty;
- its first `SAMPLE` rows, and `SAMPLE` more spread through a JSON-lines file, must parse (valid
  UTF-8 and JSON objects for JSON lines; a JSON list up to `JSON_LIST_MAX_BYTES`; the header and
  rows of a CSV; a parquet file's schema and first rows), hold the configured columns, and, with
  `on_bad_row: error`, pass the checks every row passes at load (envs/rows.py `problem`).
A problem is one line naming the key and the file (`task.params.prompt_key: no column 'question'
in data/train.jsonl (columns: q, a)`), or the file and line of a bad row
(`data/train.jsonl:7: no 'question'`), as the learner would name it.

Reading is bounded: 2 x SAMPLE lines of a JSON-lines file whatever its size, SAMPLE rows of a CSV
or parquet file; only an error in a row far into a JSON-lines file counts the lines before it.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflash.envs.dataset import DatasetTask
from rollflash.envs.dataset_source import BUILDERS, is_blank, looks_local
from rollflash.envs.rows import ANSWER, ID, MESSAGES, TEXT, line_problem, problem
from rollflash.errors import BadInput, MissingFile

SAMPLE = 32  # rows read from the start of a file, and as many spread through a JSON-lines file
JSON_LIST_MAX_BYTES = 64 << 20  # a JSON list larger than this is left to the learner

Row = tuple[int | None, int, Any]  # (line or row number, byte offset of a JSON line, the row)


def check_dataset(task: DatasetTask, where: str = "task.params") -> None:
    """Check `task`'s sources (module docstring); `where` names its parameters in errors."""
    check_source(task, task.path, f"{where}.path", where)
    if task.eval_path:
        check_source(task, task.eval_path, f"{where}.eval_path", where)


def check_source(task: DatasetTask, source: str, key: str, where: str) -> None:
    path = Path(source).expanduser()
    if not path.exists():
        if looks_local(source):
            raise MissingFile(f"{key}: no such file or directory: {source}")
        return  # a hub dataset id: read from the Hugging Face cache by the learner
    if path.is_dir():
        return
    suffix = path.suffix.lower()
    if suffix not in BUILDERS:
        raise BadInput(
            f"{key}: {source} is not .jsonl, .json, .parquet or .csv (or a directory written "
            "by save_to_disk)"
        )
    if suffix != ".parquet" and is_blank(path):
        raise BadInput(f"{key}: {source} is empty, no rows")
    columns, rows = _sample(path, source, suffix, task.max_row_bytes)
    if not rows:
        raise BadInput(f"{key}: {source} has no rows")
    for param, column in _wanted(task):
        if column not in columns:
            raise BadInput(
                f"{where}.{param}: no column {column!r} in {source} "
                f"(columns: {', '.join(sorted(columns))})"
            )
    if task.on_bad_row == "error":
        _check_rows(task, path, source, rows)


def _wanted(task: DatasetTask) -> list[tuple[str, str]]:
    """The columns the task's parameters name, as (parameter, column)."""
    prompt = ("messages_key", task.messages_key) if task.messages_key else None
    keys = [prompt or ("prompt_key", task.prompt_key), ("answer_key", task.answer_key)]
    keys += [("id_key", task.id_key)] + [("extra_keys", k) for k in task.extra_keys or []]
    return [(p, k) for p, k in keys if k is not None]


def _check_rows(task: DatasetTask, path: Path, source: str, rows: list[Row]) -> None:
    kinds = [(task.messages_key, MESSAGES) if task.messages_key else (task.prompt_key, TEXT)]
    if task.answer_key is not None and task.needs_answer:
        kinds.append((task.answer_key, ANSWER))
    if task.id_key is not None:
        kinds.append((task.id_key, ID))
    for number, offset, row in rows:
        for column, kind in kinds:
            found = problem(kind, column, row.get(column))
            if found:
                raise BadInput(f"{source}:{number or _line_at(path, offset)}: {found}")


def _sample(path: Path, source: str, suffix: str, max_row_bytes: int) -> tuple[set[str], list[Row]]:
    """The columns and sampled rows of a file."""
    if suffix == ".parquet":
        return _parquet(path, source)
    if suffix == ".csv":
        return _csv(path, source)
    with open(path, "rb") as f:
        is_list = f.read(4096).lstrip()[:1] == b"["
    rows = _json_list(path, source) if is_list else _json_lines(path, source, max_row_bytes)
    return {k for _, _, r in rows for k in r}, rows


def _parse(raw: bytes, source: str, line: Callable[[], int], max_row_bytes: int) -> Any:
    """One JSON-lines row, or the line naming why it is not one (`line()`: where it is): the
    learner's own checks first (envs/rows.py `line_problem`), then the JSON."""
    _, why = line_problem(raw, max_row_bytes)
    if why is not None:
        raise BadInput(f"{source}:{line()}: {why}")
    try:
        row = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        why = f"not valid JSON ({e})"
    else:
        if isinstance(row, dict):
            return row
        why = "not a JSON object"
    raise BadInput(f"{source}:{line()}: {why}")


def _json_lines(path: Path, source: str, max_row_bytes: int) -> list[Row]:
    """The first SAMPLE rows, then one row at each of SAMPLE offsets spread over the rest."""
    rows: list[Row] = []
    size = path.stat().st_size
    with open(path, "rb") as f:
        number = 0
        while len(rows) < SAMPLE and (raw := f.readline(max_row_bytes + 1)):
            number += 1
            if raw.strip():
                rows.append(
                    (number, 0, _parse(raw, source, functools.partial(int, number), max_row_bytes))
                )
        head = f.tell()
        starts: set[int] = set()
        for k in range(SAMPLE):
            f.seek(head + (size - head) * k // SAMPLE)
            if f.tell() > head:
                f.seek(f.tell() - 1)
                f.readline()  # to the start of the next line
            start, raw = f.tell(), f.readline(max_row_bytes + 1)
            if raw.strip() and start not in starts:
                starts.add(start)
                rows.append(
                    (
                        None,
                        start,
                        _parse(
                            raw, source, functools.partial(_line_at, path, start), max_row_bytes
                        ),
                    )
                )
    return rows


def _line_at(path: Path, offset: int) -> int:
    """The line number (from 1) of the line starting at byte `offset`."""
    lines, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 20, offset - done))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            done += len(chunk)
    return lines


def _json_list(path: Path, source: str) -> list[Row]:
    if path.stat().st_size > JSON_LIST_MAX_BYTES:
        return [(1, 0, {})]  # left to the learner: reading it would take the time it takes
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise BadInput(f"{source}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, list):
        raise BadInput(f"{source}: not a JSON list of rows")
    picks = sorted(
        {*range(min(SAMPLE, len(data)))} | {len(data) * k // SAMPLE for k in range(SAMPLE)}
    )
    rows: list[Row] = []
    for i in picks:
        if i < len(data):
            if not isinstance(data[i], dict):
                raise BadInput(f"{source}:{i + 1}: not a JSON object")
            rows.append((i + 1, 0, data[i]))
    return rows


def _csv(path: Path, source: str) -> tuple[set[str], list[Row]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = set(reader.fieldnames or [])
            rows: list[Row] = []
            for row in reader:
                if any(v not in (None, "") for v in row.values()):  # a blank line is no row
                    # an empty field is null, as the learner's CSV reader (pandas) reads it
                    rows.append((reader.line_num, 0, {k: v or None for k, v in row.items()}))
                if len(rows) >= SAMPLE:
                    break
    except (UnicodeDecodeError, csv.Error) as e:
        raise BadInput(f"{source}: cannot be read ({e.__class__.__name__}: {e})") from None
    return columns, rows


def _parquet(path: Path, source: str) -> tuple[set[str], list[Row]]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
        columns = set(f.schema_arrow.names)
        batch = next(f.iter_batches(batch_size=SAMPLE), None)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError: one line naming the file
        raise BadInput(f"{source}: cannot be read ({e.__class__.__name__}: {e})") from None
    rows = [] if batch is None else batch.to_pylist()
    return columns, [(i + 1, 0, r) for i, r in enumerate(rows)]
