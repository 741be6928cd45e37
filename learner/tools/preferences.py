"""Preference pairs for reward-model training (learner/tools/rm_training.py): one JSON object a line,
`{"prompt": ..., "chosen": ..., "rejected": ...}`.

A bad file stops before any training with one line naming the file and line number:
`preferences.jsonl:7: field 'rejected' is empty`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rollflash.errors import MissingFile, RollflashError

FIELDS = ("prompt", "chosen", "rejected")


class PreferenceFileError(RollflashError, ValueError):
    """A preference file that cannot be used; the message is `path:line: what is wrong`."""


@dataclass(frozen=True)
class PreferencePair:
    prompt: str  # the context both responses answer (may be empty)
    chosen: str  # the preferred response (non-empty)
    rejected: str  # the other response (non-empty, different from chosen)


def parse_pair(line: str, where: str) -> PreferencePair:
    """One JSONL line -> PreferencePair; `where` ("file:line") prefixes every error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PreferenceFileError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise PreferenceFileError(
            f"{where}: expected a JSON object with fields "
            f"{', '.join(FIELDS)}, got {type(row).__name__}"
        )
    for key in FIELDS:
        if key not in row:
            raise PreferenceFileError(f"{where}: missing field {key!r} (needs {', '.join(FIELDS)})")
        if not isinstance(row[key], str):
            raise PreferenceFileError(
                f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}"
            )
    for key in ("chosen", "rejected"):
        if not row[key].strip():
            raise PreferenceFileError(f"{where}: field {key!r} is empty")
    if row["chosen"] == row["rejected"]:
        raise PreferenceFileError(f"{where}: 'chosen' and 'rejected' are the same text")
    return PreferencePair(row["prompt"], row["chosen"], row["rejected"])


def load_preferences(path: str | Path) -> list[PreferencePair]:
    """Every pair of a JSONL file (blank lines skipped); the first bad line raises
    PreferenceFileError naming `path:line`."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(
            f"rm.dataset: no preference file at {path} (make one with scripts/make_preferences.py)"
        )
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                pairs.append(parse_pair(line, f"{path}:{number}"))
    if not pairs:
        raise PreferenceFileError(f"{path}: no preference pairs")
    return pairs


def split_pairs(
    pairs: list[PreferencePair], eval_split: float
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out): the last ceil(eval_split * len) pairs are held out (at least one, and at
    least one pair is left to train on)."""
    if len(pairs) < 2:
        raise PreferenceFileError(
            f"need at least 2 preference pairs to hold some out, got {len(pairs)}"
        )
    held = min(max(1, math.ceil(eval_split * len(pairs))), len(pairs) - 1)
    return pairs[:-held], pairs[-held:]
