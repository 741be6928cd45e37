"""The trajectory ids a rank has consumed, remembered with bounded memory: each id is filed under
the learner step its prompt was issued at, and whole steps are forgotten once they fall below a
floor that follows the learner, `keep_steps` = max_overdue + KEEP_MARGIN behind it. An entry
whose prompt was issued before the floor is judged stale before the ids are consulted, so a
forgotten id is never trained twice (docs/faults.md, "Exactly-once with bounded memory").

Every copy of a trajectory carries the `issued_version` of the prompt entry it answers (set once,
at admission), so all copies of an id are filed under the same step: an id is either remembered
or older than the floor, never remembered under a step other than the one a copy would name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

# steps beyond max_overdue that consumed ids are remembered for: ordinary reordering stays well
# inside this window (docs/faults.md, "Exactly-once with bounded memory")
KEEP_MARGIN = 32


class RecentIds:
    def __init__(self) -> None:
        self._step: dict[str, int] = {}  # id -> issue step
        self._by_step: dict[int, list[str]] = {}  # issue step -> ids

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._step

    def __len__(self) -> int:
        return len(self._step)

    def add(self, traj_id: str, issue_step: int) -> None:
        if traj_id not in self._step:
            self._step[traj_id] = issue_step
            self._by_step.setdefault(issue_step, []).append(traj_id)

    def discard(self, traj_id: str) -> None:
        """Forget one id (its entry was refused: an answer issued again is not a copy)."""
        step = self._step.pop(traj_id, None)
        if step is not None:
            self._by_step[step].remove(traj_id)

    def update(self, ids: Iterable[tuple[str, int]]) -> None:
        for traj_id, issue_step in ids:
            self.add(traj_id, issue_step)

    def forget_before(self, floor: int) -> int:
        """Forget every id issued before step `floor`; returns how many were forgotten."""
        forgotten = 0
        for s in [s for s in self._by_step if s < floor]:
            for traj_id in self._by_step.pop(s):
                del self._step[traj_id]
                forgotten += 1
        return forgotten

    def pairs(self) -> list[tuple[str, int]]:
        return list(self._step.items())


class ConsumedIds:
    """The ids this rank read (`seen`) and those any rank trained (`trained`), from the floor on."""

    def __init__(self, max_overdue: int):
        self.keep_steps = max_overdue + KEEP_MARGIN
        self.floor = 0  # ids of prompts issued before this step are forgotten
        self.seen = RecentIds()
        self.trained = RecentIds()

    def move_floor(self, step: int) -> None:
        """Move the floor to `step - keep_steps` (never back) and forget what lies below it."""
        self.floor = max(self.floor, step - self.keep_steps)
        self.seen.forget_before(self.floor)
        self.trained.forget_before(self.floor)

    def consume(self, traj_id: str, issue_step: int) -> Literal["stale", "duplicate"] | None:
        """None, and `traj_id` remembered as seen, for the first copy of an id; "stale" for an
        entry issued before the floor (its id may be forgotten: never trained), whatever the ids
        say; "duplicate" for an id consumed before."""
        if issue_step < self.floor:
            return "stale"
        if traj_id in self.seen or traj_id in self.trained:
            return "duplicate"
        self.seen.add(traj_id, issue_step)
        return None

    def forget(self, traj_ids: Iterable[str]) -> None:
        """Forget ids this rank read (a refused group's: its answers issued again are no copies)."""
        for traj_id in traj_ids:
            self.seen.discard(traj_id)

    def restore(self, consumed: dict[int, list[str]]) -> None:
        """Take the consumed ids of a checkpoint (issue step -> ids) as seen."""
        self.seen.update((t, s) for s, ids in consumed.items() for t in ids)

    def by_step(self) -> dict[int, list[str]]:
        """issue step -> every id consumed, the form a checkpoint stores."""
        out: dict[int, set[str]] = {}
        for traj_id, step in self.seen.pairs() + self.trained.pairs():
            out.setdefault(step, set()).add(traj_id)
        return {s: sorted(ids) for s, ids in sorted(out.items())}
