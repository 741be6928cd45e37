"""Which training step each published weight version holds (checkpointed with the learner's state,
learner/durability/checkpoint.py; staleness and admission are measured with it,
learner/intake/collect.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Lineage:
    """Which training step each published weight version holds.

    Without a crash version == step. After a resume from the checkpoint of step s while versions up
    to V were already published, the next version is V + 1 but holds step s + 1: versions stay
    monotonic for generators, while staleness and admission are measured in steps of the surviving
    lineage. Versions s + 1 .. V (published by the dead process) keep the steps they were published
    with, so samples drawn with them count as fresh, not as V - s steps old.
    """

    offsets: list[list[int]] = field(default_factory=lambda: [[0, 0]])  # [first_version, offset]

    def step_of(self, version: int) -> int:
        offset = 0
        for first, off in self.offsets:
            if version >= first:
                offset = off
        return version - offset

    def rebase(self, next_version: int, next_step: int) -> None:
        """From `next_version` on, version v holds step v - (next_version - next_step)."""
        self.offsets.append([next_version, next_version - next_step])
