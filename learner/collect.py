"""Gathering one step's groups from the trajectories stream.

For learner version v, `collect` reads until it holds `rollout_batch_size` complete, fresh groups:
- invalid entries were already dead-lettered by the broker; they are replaced by fresh prompts;
- an entry `traj_id` seen before (a retried generator) is acknowledged and counted as a duplicate;
- entries are assembled into groups (learner/assemble.py: one entry per group, or one per sample
  with prompt replication); samples for an already complete group are acknowledged as late;
- a group whose oldest token is older than v - ceil(async_ratio) is acknowledged, counted as stale
  and replaced by a fresh prompt;
- a group a DAPO filter rejects (`drop` returns the reason: dynamic sampling, overlong) is
  acknowledged, counted and replaced too, up to FILTER_CAP x B per step, after which groups are
  kept anyway so that a model that solves every prompt cannot make a step wait forever.
Accepted entries are NOT acknowledged here: the caller acknowledges them once the update that used
them is published, so a learner crash re-delivers them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from broker.schema import Trajectory
from broker.streams import RunBroker
from learner.admission import Admission
from learner.assemble import GroupAssembler

log = logging.getLogger(__name__)


FILTER_CAP = 4  # at most this many batches' worth of filtered groups are replaced per step


class NoData(RuntimeError):
    """No trajectory arrived within the configured wait."""


@dataclass
class Collected:
    groups: list[Trajectory] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)  # to acknowledge after publishing
    stale_ids: list[str] = field(default_factory=list)  # group ids dropped as too old
    duplicate_ids: list[str] = field(default_factory=list)  # entry traj_ids seen before
    late_ids: list[str] = field(default_factory=list)  # samples for already complete groups
    filtered_ids: list[str] = field(default_factory=list)  # groups dropped by a DAPO filter
    filtered: Counter = field(default_factory=Counter)  # filter reason -> dropped groups
    rejected: int = 0
    wait_s: float = 0.0
    staleness: Counter = field(default_factory=Counter)  # version lag -> accepted groups


def _sort_entry(out: Collected, entry_id: str, traj: Trajectory, assembler: GroupAssembler,
                seen: set[str], version: int, max_staleness: int, admission: Admission,
                drop: Callable[[Trajectory], str | None]) -> list[str]:
    """File one entry under duplicate / late / pending / stale / accepted; returns ids to ack now."""
    if traj.traj_id in seen:
        out.duplicate_ids.append(traj.traj_id)
        return [entry_id]
    seen.add(traj.traj_id)
    if assembler.is_late(traj):
        out.late_ids.append(traj.traj_id)
        return [entry_id]
    done = assembler.add(entry_id, traj)
    if done is None:
        return []  # stays pending until its group completes
    oldest = done.group.behavior_version
    if oldest < version - max_staleness:
        out.stale_ids.append(done.group.group_id)
        admission.replace(1)
        return done.entry_ids
    reason = drop(done.group)
    if reason is not None and len(out.filtered_ids) < FILTER_CAP * admission.batch_size:
        out.filtered[reason] += 1
        out.filtered_ids.append(done.group.group_id)
        admission.replace(1)
        return done.entry_ids
    out.groups.append(done.group)
    out.entry_ids.extend(done.entry_ids)
    out.staleness[version - oldest] += 1
    return []


def collect(broker: RunBroker, admission: Admission, assembler: GroupAssembler, version: int,
            max_staleness: int, seen: set[str], vocab_size: int, consumer: str,
            timeout_s: float, drop: Callable[[Trajectory], str | None] = lambda g: None
            ) -> Collected:
    want = admission.batch_size
    out = Collected()
    started = last_arrival = time.monotonic()
    while len(out.groups) < want:
        admission.top_up(broker, version)
        # each entry completes at most one group, so this never reads past the batch
        good, bad = broker.read_trajectories(consumer, count=want - len(out.groups),
                                             block_ms=500, vocab_size=vocab_size)
        if good or bad:
            last_arrival = time.monotonic()
        elif time.monotonic() - last_arrival > timeout_s:
            raise NoData(f"no trajectory arrived for {timeout_s:.0f}s at version {version}: are "
                         "generators running (rollctl status)?")
        out.rejected += len(bad)
        admission.replace(len(bad))
        ack_now = []
        for entry_id, traj in good:
            ack_now += _sort_entry(out, entry_id, traj, assembler, seen, version, max_staleness,
                                   admission, drop)
        broker.ack_trajectories(ack_now)
    out.wait_s = time.monotonic() - started
    return out
