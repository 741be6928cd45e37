"""Assembling complete groups from trajectory entries.

An entry holds either a whole group (the default: one generator sampled all n responses of a
prompt) or a single sample (`rollout.replicate_prompts`: the n (+ r redundant) samples of a group
were spread over generators). Either way a group is complete once n samples with its `group_id`
have arrived; the first n to arrive are kept, and samples arriving for a group that is already
complete (redundant sampling's slow tail) are dropped and counted.

Entries of an incomplete group stay pending in the consumer group (not acknowledged), so a crash
re-delivers them; the caller acknowledges all of a group's entries together.

State stays bounded: the ids of completed groups, and incomplete groups themselves, are forgotten
once their prompt's issue step, or the step their first entry arrived at, falls below the
remembered ids' floor (`forget_before`, learner/intake/recent.py): however far ahead an entry claims its
prompt was issued (the learner refuses a version newer than its own, broker/channels/provenance.py), a
partial group is held at most keep_steps steps. The caller drops anything that old before it
reaches `is_late` or `add` (learner/intake/triage.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.intake.recent import RecentIds


@dataclass
class _Partial:
    issue_step: int  # the learner step its prompt was issued at
    first_seen: int  # the learner step its first entry arrived at
    parts: list[Trajectory] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(len(p.samples) for p in self.parts)


@dataclass
class Completed:
    group: Trajectory  # the n samples of one prompt, traj_id = group_id
    entry_ids: list[str]  # every stream entry that contributed
    traj_ids: list[str]  # the traj_id of each of those entries


class GroupAssembler:
    def __init__(self, group_size: int):
        self.group_size = group_size
        self.partial: dict[str, _Partial] = {}
        self.completed = RecentIds()  # group ids already handed out (late samples are dropped)

    def is_late(self, traj: Trajectory) -> bool:
        return traj.group_id in self.completed

    def add(
        self, entry_id: str, traj: Trajectory, issue_step: int = 0, first_seen: int = 0
    ) -> Completed | None:
        """Add one entry (its prompt issued at learner step `issue_step`, read at step
        `first_seen`); returns the group when this entry completes it."""
        p = self.partial.setdefault(traj.group_id, _Partial(issue_step, first_seen))
        p.parts.append(traj)
        p.entry_ids.append(entry_id)
        if p.samples < self.group_size:
            return None
        del self.partial[traj.group_id]
        self.completed.add(traj.group_id, p.issue_step)
        samples = [s for part in p.parts for s in part.samples][: self.group_size]
        first = p.parts[0]
        merged = dataclasses.replace(
            first,
            traj_id=first.group_id,
            samples=samples,
            behavior_version=min(
                (int(s.token_versions.min()) for s in samples if s.token_versions.size),
                default=first.behavior_version,
            ),
            generator=",".join(sorted({part.generator for part in p.parts})),
        )
        return Completed(merged, p.entry_ids, [part.traj_id for part in p.parts])

    def forget_before(self, floor: int) -> list[Completed]:
        """Forget completed groups issued before step `floor`, and remove the incomplete ones
        issued before it; returns those (group = the first part) for the caller to drop."""
        self.completed.forget_before(floor)
        return self.remove(lambda _, p: min(p.issue_step, p.first_seen) < floor)

    def remove(self, which: Callable[[list[str], _Partial], bool]) -> list[Completed]:
        """Remove the incomplete groups for which `which(entry_ids, partial)` holds; returns
        them (group = the first part)."""
        out = []
        for gid in [gid for gid, p in self.partial.items() if which(p.entry_ids, p)]:
            p = self.partial.pop(gid)
            out.append(Completed(p.parts[0], p.entry_ids, [part.traj_id for part in p.parts]))
        return out

    def pending_entry_ids(self) -> list[str]:
        """The refs of the entries held in incomplete groups (pending in the stream)."""
        return [e for p in self.partial.values() for e in p.entry_ids]

    def pending_traj_ids(self) -> list[str]:
        """The traj_ids of the entries held in incomplete groups (pending in the stream)."""
        return [part.traj_id for p in self.partial.values() for part in p.parts]
