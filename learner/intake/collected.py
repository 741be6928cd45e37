"""What one rank collected for a step (learner/intake/collect.py): its share of the step's groups, the
stream entries to acknowledge after the checkpoint, and what became of every other entry."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.metrics.lengths import Lengths


@dataclass
class Collected:
    groups: list[Trajectory] = field(default_factory=list)  # this rank's share of the step
    entry_ids: list[str] = field(default_factory=list)  # to acknowledge after the checkpoint
    part_ids: list[str] = field(default_factory=list)  # the traj_id of each of those entries
    stale_ids: list[str] = field(default_factory=list)  # ids dropped as too old
    duplicate_ids: list[str] = field(default_factory=list)  # entry traj_ids seen before
    late_ids: list[str] = field(default_factory=list)  # samples for already complete groups
    retried_ids: list[str] = field(default_factory=list)  # first copies of re-delivered prompts
    filtered_ids: list[str] = field(default_factory=list)  # groups dropped by a DAPO filter
    filtered: Counter = field(default_factory=Counter)  # filter reason -> dropped groups
    rejected: int = 0
    issued: int = 0  # prompts rank 0 issued while collecting this step (admission top-ups)
    refused: int = 0  # entries of quarantined generators dropped
    wait_s: float = 0.0
    staleness: Counter = field(default_factory=Counter)  # steps of lag -> accepted groups
    overdue: int = 0  # groups accepted older than max_staleness (learner/intake/ready.py)
    tally: Lengths = field(default_factory=Lengths)  # this rank's response lengths by fate
    # the lengths' metrics and `async/overdue`, over all ranks (the same on every rank)
    step_wide: dict[str, float] = field(default_factory=dict)
