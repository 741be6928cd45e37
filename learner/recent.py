"""A set of ids that forgets by age: each id is filed under the learner step its prompt was issued
at, and whole steps are forgotten once they fall below a floor (learner/collect.py explains the
floor and why forgetting keeps exactly-once).

Every copy of a trajectory carries the `issued_version` of the prompt entry it answers (set once,
at admission), so all copies of an id are filed under the same step: an id is either remembered
or older than the floor, never remembered under a step other than the one a copy would name.
"""

from __future__ import annotations

from collections.abc import Iterable


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

    def by_step(self) -> dict[int, list[str]]:
        """issue step -> ids (a copy), the form a checkpoint stores."""
        return {s: list(ids) for s, ids in sorted(self._by_step.items())}

    def pairs(self) -> list[tuple[str, int]]:
        return list(self._step.items())
