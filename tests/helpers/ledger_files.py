"""Reading a run's ledger files back (learner/durability/ledger.py) the way a person checking exactly-once
would: the rows of the final lineage, every entry's recorded outcomes, the trained ids."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollflash.learner.durability.ledger import rows_since

DROPS = ("stale", "duplicate", "late", "filtered", "dead_lettered", "refused")
OUTCOMES = ("trained", *DROPS)


def read(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The rows of ledger files (a line cut by a crash mid-write, if any, left out)."""
    return [row for path in paths for row in rows_since(path, 0)]


def surviving(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One file's rows of the final lineage: a resume from step s discards the trained rows of
    steps after s written before it; `acked` rows all stay (their entries were acknowledged)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.get("event") == "resume":
            out = [r for r in out if r.get("event") == "acked" or r["step"] <= row["step"]]
        elif row.get("event") in (None, "acked"):
            out.append(row)
    return out


def audit(files: list[list[dict[str, Any]]]) -> dict[str, list[str]]:
    """Entry ref -> the outcomes recorded for it in the final lineage, over every rank's file.
    Exactly-once holds when each acknowledged entry has exactly one."""
    out: dict[str, list[str]] = {}
    for rows in files:
        for row in surviving(rows):
            if row.get("event") is None:
                for r in row.get("refs", []):
                    out.setdefault(r, []).append("trained")
            else:
                for outcome, refs in row.get("refs", {}).items():
                    for r in refs:
                        out.setdefault(r, []).append(outcome)
    return out


def trained_ids(files: list[list[dict[str, Any]]]) -> list[str]:
    """Every traj_id trained in the final lineage (a duplicate would appear twice)."""
    return [t for rows in files for row in surviving(rows) for t in row.get("trained", [])]
