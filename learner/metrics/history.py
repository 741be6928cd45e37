"""What the run's summary needs from its steps (`summary.json`), in constant memory however many
steps the run has, and checkpointed, so a resumed learner's summary covers the whole run: the
first and the last ten steps' mean rewards and the largest staleness of the surviving lineage
(steps that a crash lost, trained again after the resume, are counted once). Figures of the
process alone carry `_this_process` in their names."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW = 10


@dataclass
class History:
    first_rewards: list[float] = field(default_factory=list)  # reward/mean of steps 1-10
    last_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    max_staleness: float = 0
    steps_this_process: int = 0

    def add(self, reward_mean: float, staleness_max: float) -> None:
        """One step: its mean reward and its largest staleness, over every rank."""
        self.steps_this_process += 1
        if len(self.first_rewards) < WINDOW:
            self.first_rewards.append(reward_mean)
        self.last_rewards.append(reward_mean)
        self.max_staleness = max(self.max_staleness, staleness_max)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's record (the count of this process's steps is not part of it)."""
        return {
            "first_rewards": self.first_rewards,
            "last_rewards": list(self.last_rewards),
            "max_staleness": self.max_staleness,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        return cls(
            first_rewards=list(d.get("first_rewards", [])),
            last_rewards=deque(d.get("last_rewards", []), maxlen=WINDOW),
            max_staleness=d.get("max_staleness", 0),
        )
