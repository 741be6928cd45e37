"""The groups a learner rank has accepted but not trained yet, and which of them a step takes.

A group's age at step s is s minus the step of its oldest token's version (learner/intake/lineage.py:
without a resume, step == version). With a = `trainer.async_ratio` and B groups per step:
- a group that arrives at most ceil(a) steps old is accepted;
- a group that arrives older than that, up to `trainer.max_overdue_staleness` = ceil(a) +
  `trainer.overdue_steps`, is *overdue*: it was still being generated (or unread in the stream)
  when it reached ceil(a) steps, which is what a long response does. It is accepted and counted
  (`async/overdue`) instead of being dropped, so the bound does not select short responses.
  With `overdue_steps: 0` it is dropped as stale and replaced, a strict bound that costs long
  responses (`length/stale_mean`, learner/metrics/lengths.py);
- an older arrival is dropped as stale, counted, and replaced by a fresh prompt.
A step takes its groups oldest first (by the step of their oldest token, then in arrival order),
and the ranks first split the groups that could not wait for the next step (`due`: ceil(a) or
more steps old, overdue ones included; learner/process/dist.py `split_quotas`). So a group accepted in
time is trained before it is older than ceil(a) steps, and an overdue group in the step it
arrives in, unless the ranks hold more than B due groups at once: those left over are dropped as
stale at the next step (`aged`), the only way a group that arrived in time is lost.

Guarantee: every trained group is at most ceil(a) steps old, or at most ceil(a) + overdue_steps
if its own generation outlasted ceil(a) steps; nothing that arrives within those bounds is
dropped while fewer than B groups are due in a step. With a = 0 nothing is overdue: generators
start a prompt only with the weights it was issued for, so training stays on-policy. Generators
restart a group that grows older than the overdue bound while they decode it
(generators/continuous.py), since the learner would drop it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.intake.lineage import Lineage


@dataclass
class Ready:
    """An accepted group not yet trained, with the stream entries to acknowledge once it is."""

    group: Trajectory
    entry_ids: list[str]  # refs of its entries (broker/channels/trajectories.py)
    traj_ids: list[str]  # the traj_id of each of those entries (pending until trained)


class ReadyGroups:
    """One rank's accepted groups, with the age rules of the module docstring."""

    def __init__(self, lineage: Lineage, max_staleness: int, max_overdue: int):
        self.lineage, self.max_staleness, self.max_overdue = lineage, max_staleness, max_overdue
        self.groups: list[Ready] = []

    def __len__(self) -> int:
        return len(self.groups)

    def age(self, group: Trajectory, step: int) -> int:
        return step - self.lineage.step_of(group.behavior_version)

    def too_old(self, group: Trajectory, step: int) -> bool:
        """Whether a group arriving at `step` is stale (older than the overdue bound)."""
        return self.age(group, step) > self.max_overdue

    def overdue(self, group: Trajectory, step: int) -> bool:
        return self.age(group, step) > self.max_staleness

    def add(self, ready: Ready) -> None:
        self.groups.append(ready)

    def due(self, step: int) -> int:
        """Groups this step must take: at the next step they would be too old."""
        return sum(self.age(r.group, step) >= self.max_staleness for r in self.groups)

    def aged(self, step: int) -> list[Ready]:
        """Remove and return the groups kept past their last step (more were due than taken)."""
        return self.remove(lambda r: self.age(r.group, step) > self.max_staleness)

    def take(self, quota: int) -> list[Ready]:
        """Remove and return the `quota` oldest groups (arrival order among equals)."""
        self.groups.sort(key=lambda r: self.lineage.step_of(r.group.behavior_version))
        taken, self.groups = self.groups[:quota], self.groups[quota:]
        return taken

    def remove(self, which: Callable[[Ready], bool]) -> list[Ready]:
        """Remove and return the groups for which `which` holds."""
        out = [r for r in self.groups if which(r)]
        self.groups = [r for r in self.groups if not which(r)]
        return out

    def entry_ids(self) -> set[str]:
        return {e for r in self.groups for e in r.entry_ids}

    def traj_ids(self) -> list[str]:
        return [t for r in self.groups for t in r.traj_ids]
