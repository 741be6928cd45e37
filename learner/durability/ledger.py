"""The ledger: what the learner did with every trajectory entry it acknowledged, durably.

`{run_dir}/ledger.jsonl` (rank r > 0: `ledger.rank{r}.jsonl`) holds one JSON object a line:
- `{"event": "acked", "step": s, "<outcome>": [traj_id, ...], ..., "refs": {"<outcome>":
  [ref, ...], ...}, "finished": [...], "replaced": n}`: entries dropped while step s was
  collected (outcomes
  `stale`, `duplicate`, `late`, `filtered`, `dead_lettered`, `refused`; a ref names a stream
  entry, `{generator}/{entry id}`), written and fsynced *before* the one Redis call that
  acknowledges them (with `finished` and `replaced`, broker/channels/trajectories.py `ack`);
- `{"step": s, "version": v, "trained": [traj_id, ...], "refs": [...], "retried": [...]}`: the
  groups trained by step s, fsynced before the checkpoint that acknowledges them;
- `{"event": "resume", "step": s, "version": v}`: a learner resumed from the checkpoint of step
  s; the trained rows of steps after s, written before it, are of a lineage that no longer
  exists (their entries were never acknowledged, and are read and recorded again).

So every acknowledged entry has a record written before its acknowledgement, across any number of
crashes. Exactly one: a crash between a record and its acknowledgement leaves the entry pending,
and the resumed learner replays the `acked` records written since its checkpoint (`rows_since`,
learner/rank.py `resume_after`), acknowledging those entries as recorded instead of reading
them again; the acknowledgement is idempotent, so replaying one that had run changes nothing.
The fault tests read the files back the way a person checking exactly-once would
(tests/helpers/ledger_files.py).

Every line is written only after the run's lease is checked (broker/channels/lease.py), so a learner that
lost the lease adds no record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflash.learner.process.hooks import FaultHooks


class Ledger:
    def __init__(
        self, path: Path, fence: Callable[[], None] = lambda: None, hooks: FaultHooks = FaultHooks()
    ):
        self.path, self.fence, self.hooks = path, fence, hooks
        self._f = open(path, "a")

    def offset(self) -> int:
        """Bytes written so far (a checkpoint keeps it: replays start there)."""
        return self._f.tell()

    def acked(
        self,
        step: int,
        outcomes: dict[str, list[str]],
        refs: dict[str, list[str]],
        finished: list[str],
        replaced: int,
    ) -> None:
        """Record entries about to be acknowledged (see the module docstring): traj_ids and
        entry refs by outcome."""
        row: dict[str, Any] = {"event": "acked", "step": step}
        row.update({k: v for k, v in outcomes.items() if v})
        row.update(refs={k: v for k, v in refs.items() if v}, finished=finished, replaced=replaced)
        self._write(row)

    def trained(self, row: dict[str, Any]) -> None:
        """Record the groups step `row["step"]` trained (before its checkpoint)."""
        self._write(row)
        self.hooks.at("after_update", row["step"])

    def event(self, **fields: Any) -> None:
        self._write(fields)

    def _write(self, row: dict[str, Any]) -> None:
        self.fence()
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def refs_of(row: dict[str, Any]) -> list[str]:
    """Every entry ref of a row (an `acked` row files them by outcome)."""
    refs = row.get("refs", [])
    return [r for rs in refs.values() for r in rs] if isinstance(refs, dict) else list(refs)


def rows_since(path: Path, offset: int) -> list[dict[str, Any]]:
    """The records written at or after byte `offset` (a line cut by a crash left out)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
