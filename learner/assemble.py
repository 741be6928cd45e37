"""Assembling complete groups from trajectory entries.

An entry holds either a whole group (the default: one generator sampled all n responses of a
prompt) or a single sample (`rollout.replicate_prompts`: the n (+ r redundant) samples of a group
were spread over generators). Either way a group is complete once n samples with its `group_id`
have arrived; the first n to arrive are kept, and samples arriving for a group that is already
complete (redundant sampling's slow tail) are dropped and counted.

Entries of an incomplete group stay pending in the consumer group (not acknowledged), so a crash
re-delivers them; the caller acknowledges all of a group's entries together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rollflash.broker.schema import Trajectory


@dataclass
class _Partial:
    parts: list[Trajectory] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(len(p.samples) for p in self.parts)


@dataclass
class Completed:
    group: Trajectory  # the n samples of one prompt, traj_id = group_id
    entry_ids: list[str]  # every stream entry that contributed


class GroupAssembler:
    def __init__(self, group_size: int):
        self.group_size = group_size
        self.partial: dict[str, _Partial] = {}
        self.completed: set[str] = set()  # group ids already handed out (late samples are dropped)

    def is_late(self, traj: Trajectory) -> bool:
        return traj.group_id in self.completed

    def add(self, entry_id: str, traj: Trajectory) -> Completed | None:
        """Add one entry; returns the group when this entry completes it."""
        p = self.partial.setdefault(traj.group_id, _Partial())
        p.parts.append(traj)
        p.entry_ids.append(entry_id)
        if p.samples < self.group_size:
            return None
        del self.partial[traj.group_id]
        self.completed.add(traj.group_id)
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
        return Completed(group=merged, entry_ids=p.entry_ids)

    @property
    def pending_samples(self) -> int:
        return sum(p.samples for p in self.partial.values())
