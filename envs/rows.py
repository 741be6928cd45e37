"""Checking a dataset's rows when it loads (envs/dataset.py), before any of them is trained on.

Each configured column is checked in every row, by kind:
- `text` (the prompt column): present, text, not blank;
- `messages` (the chat column): a non-empty list of {"role": text, "content": text};
- `answer` (only when the task's reward functions read the answer): present, text or a number,
  not blank;
- `id`: present, a scalar.
A string column is checked on its Arrow data at once (nulls and blank strings); any other column
(numbers where text is wanted, JSON of mixed types, lists) value by value in Python.

A bad row is named by one line, `<source>:<N>: <problem>`, e.g. `data/train.jsonl:7: no
'question'`: N is the line of the file for JSONL and CSV, else the row's number from 1; the
source of a hub dataset or a save_to_disk directory is written `<path>[<split>]`.

Before a JSON or CSV file reaches the readers, `check_file` reads its lines as bytes and refuses,
in the same one line, a line that is not UTF-8, one longer than `max_row_bytes`, and JSON nested
deeper than MAX_DEPTH (63 levels, the row's own object one of them: the most an Arrow schema
holds). The Arrow JSON reader recurses once per level in native code, so a row of 20,000 nested
lists overflows its stack and the process dies of SIGSEGV with nothing said; a row of 64 levels
fails later with an error that names neither file nor line. These three stop the load whatever
`on_bad_row` says: the file cannot be read past them.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollflash.errors import BadInput

TEXT, MESSAGES, ANSWER, ID = "text", "messages", "answer", "id"
_BATCH = 4096
MAX_DEPTH = 63  # levels of JSON nesting a row may have, its own object one: Arrow holds 63
_TEXT_FILES = (".jsonl", ".json", ".csv")
_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')  # a JSON string: its brackets are not nesting
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


@dataclass
class BadRows:
    """Rows of one source that fail a check: their mask, and per problem its count and first row."""

    mask: Any  # np.ndarray [rows] bool
    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, int] = field(default_factory=dict)

    def add(self, rows: Iterable[int], problem: str) -> None:
        rows = [r for r in rows if not self.mask[r]]  # one problem per row: the first column's
        if rows:
            self.mask[rows] = True
            self.counts[problem] += len(rows)
            self.first[problem] = min(self.first.get(problem, rows[0]), min(rows))


def _what(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    return "a mapping" if isinstance(value, dict) else type(value).__name__


def problem(kind: str, key: str, value: Any) -> str:
    """What is wrong with `value` as the `key` column of kind `kind` ("" if nothing)."""
    if value is None:
        return f"no {key!r}"
    if kind == TEXT:
        if not isinstance(value, str):
            return f"{key!r} is {_what(value)}, not text"
    elif kind == ANSWER:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return f"{key!r} is {_what(value)}, not text or a number"
    elif kind == MESSAGES:
        ok = isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )  # fmt: skip
        return "" if ok else f"{key!r} is not a list of {{role, content}} messages"
    elif isinstance(value, (list, dict)):
        return f"{key!r} is {_what(value)}, not an id"
    if isinstance(value, str) and not value.strip():
        return f"{key!r} is empty"
    return ""


def _arrow_checks(ds: Any, key: str, kind: str, bad: BadRows) -> bool:
    """Check a string column on its Arrow data; False if it is not one (check in Python)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if getattr(ds, "_indices", None) is not None or kind == MESSAGES:
        return False
    column = ds.data.column(key)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return False
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0)
    blank = pc.fill_null(blank, False).to_numpy(zero_copy_only=False)
    bad.add(np.flatnonzero(nulls).tolist(), f"no {key!r}")
    bad.add(np.flatnonzero(blank).tolist(), f"{key!r} is empty")
    return True


def find_bad_rows(ds: Any, columns: list[tuple[str, str]]) -> BadRows:
    """The rows of `ds` whose (column, kind) checks fail (module docstring)."""
    import numpy as np

    bad = BadRows(np.zeros(len(ds), dtype=bool))
    for key, kind in columns:
        if _arrow_checks(ds, key, kind, bad):
            continue
        start = 0
        for batch in ds.select_columns([key]).iter(batch_size=_BATCH):
            values = batch[key]
            for i, value in enumerate(values):
                found = problem(kind, key, value)
                if found:
                    bad.add([start + i], found)
            start += len(values)
    return bad


def _data_lines(path: Path) -> Iterable[int]:
    """Line numbers (from 1) of the rows of a JSON-lines or CSV file, in order."""
    with open(path, newline="" if path.suffix.lower() == ".csv" else None) as f:
        if path.suffix.lower() == ".csv":
            reader = csv.reader(f)
            if next(reader, None) is None:
                return
            end = reader.line_num
            for record in reader:
                if record:  # blank lines are no rows
                    yield end + 1
                end = reader.line_num
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n


def _by_line(path: Path | None) -> bool:
    if path is None or not path.is_file():
        return False
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".csv"):
        return True
    with open(path, "rb") as f:  # a .json file holds one list, or JSON lines
        return suffix == ".json" and f.read(4096).lstrip()[:1] != b"["


def locate(label: str, path: Path | None, rows: Iterable[int]) -> dict[int, str]:
    """`<label>:<N>` for each row index (module docstring)."""
    wanted = sorted(set(rows))
    if not _by_line(path):
        return {r: f"{label}:{r + 1}" for r in wanted}
    assert path is not None
    out, todo = {}, iter(wanted)
    target = next(todo, None)
    for index, line in enumerate(_data_lines(path)):
        if target is None:
            break
        if index == target:
            out[index] = f"{label}:{line}"
            target = next(todo, None)
    return out


def unreadable(label: str, path: Path, e: Exception) -> ValueError:
    """One line for a file `datasets` could not read: its first line that is not a JSON object
    for a JSON-lines file, else the reader's error."""
    if path.suffix.lower() in (".jsonl", ".json"):
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as bad:
                    if n == 1 and line.lstrip().startswith("["):
                        break  # one JSON list: not lines
                    return BadInput(f"{label}:{n}: not valid JSON ({bad})")
                if not isinstance(row, dict):
                    return BadInput(f"{label}:{n}: not a JSON object")
    message = str(e).splitlines()[0] if str(e) else ""
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause):
        message = f"{message}: {str(cause).splitlines()[0]}" if message else str(cause)
    return BadInput(f"{label}: cannot be read ({e.__class__.__name__}: {message[:200]})")


def check_files(label: str, path: Path, max_row_bytes: int) -> None:
    """`check_file` on `path`, or on each JSON or CSV file of a directory of data files."""
    if path.is_file():
        check_file(label, path, max_row_bytes)
    elif path.is_dir():
        for file in sorted(path.rglob("*")):
            if file.suffix.lower() in _TEXT_FILES and file.is_file():
                check_file(str(file), file, max_row_bytes)


def check_file(label: str, path: Path, max_row_bytes: int) -> None:
    """Raise BadInput naming `label:line` for the first line of a JSON or CSV file that is not
    UTF-8, is longer than `max_row_bytes`, or nests JSON deeper than MAX_DEPTH (module
    docstring). A `.json` file holding one list is measured across its lines."""
    suffix = path.suffix.lower()
    if suffix not in _TEXT_FILES:
        return
    carry = suffix == ".json" and _by_line(path) is False  # one list, its rows inside it
    depth = -1 if carry else 0  # the list's own level is not a row's
    with open(path, "rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(max_row_bytes + 1), b""), 1):
            depth, why = line_problem(line, max_row_bytes, suffix != ".csv", depth, carry)
            if why is not None:
                raise BadInput(f"{label}:{n}: {why}")


def line_problem(
    line: bytes, max_row_bytes: int, json_text: bool = True, depth: int = 0, carry: bool = False
) -> tuple[int, str | None]:
    """(the JSON nesting after `line`, and why no reader can take it or None): longer than
    `max_row_bytes` (it was read with a limit of max_row_bytes + 1), not UTF-8, or (`json_text`)
    JSON nested deeper than MAX_DEPTH. Without `carry` the line is a row of its own, starting at
    depth 0; with it, it continues a list that `depth` is inside."""
    if len(line) > max_row_bytes and not line.endswith(b"\n"):
        return depth, f"a row longer than {max_row_bytes} bytes (task.params.max_row_bytes)"
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return depth, f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
    if not json_text:
        return depth, None
    after = _nesting(line, depth if carry else 0, carry)
    if after is None:
        return depth, f"JSON nested deeper than {MAX_DEPTH} levels"
    return after, None


def _nesting(line: bytes, depth: int, carry: bool) -> int | None:
    """The JSON nesting after `line`, which starts at `depth`; None past MAX_DEPTH. Without
    `carry`, what it ends at does not matter."""
    opens = line.count(b"[") + line.count(b"{")
    if depth + opens <= MAX_DEPTH and not (carry and b'"' in line):  # it cannot go deeper
        return depth + opens - line.count(b"]") - line.count(b"}")
    for c in _STRING.sub(b'""', line).translate(None, _NOT_BRACKETS):
        depth += 1 if c in b"[{" else -1
        if depth > MAX_DEPTH:
            return None
    return depth
