"""Gathering one step's groups from the trajectories stream.

For learner version v, `collect` reads until it holds `rollout_batch_size` fresh groups:
- invalid entries were already dead-lettered by the broker; they are replaced by fresh prompts;
- a `traj_id` seen before (a retried generator) is acknowledged and counted as a duplicate;
- a group whose oldest token is older than v - ceil(async_ratio) is acknowledged, counted as stale
  and replaced by a fresh prompt.
Accepted entries are NOT acknowledged here: the caller acknowledges them once the update that used
them is published, so a learner crash re-delivers them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from broker.schema import Trajectory
from broker.streams import RunBroker
from learner.admission import Admission

log = logging.getLogger(__name__)


class NoData(RuntimeError):
    """No trajectory arrived within the configured wait."""


@dataclass
class Collected:
    groups: list[Trajectory] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)  # to acknowledge after publishing
    stale_ids: list[str] = field(default_factory=list)  # traj_ids dropped as too old
    duplicate_ids: list[str] = field(default_factory=list)  # traj_ids seen before
    rejected: int = 0
    wait_s: float = 0.0
    staleness: Counter = field(default_factory=Counter)  # version lag -> accepted groups


def collect(broker: RunBroker, admission: Admission, version: int, max_staleness: int,
            seen: set[str], vocab_size: int, consumer: str, timeout_s: float) -> Collected:
    want = admission.batch_size
    out = Collected()
    started = last_arrival = time.monotonic()
    while len(out.groups) < want:
        admission.top_up(broker, version)
        good, bad = broker.read_trajectories(consumer, count=want - len(out.groups),
                                             block_ms=500, vocab_size=vocab_size)
        if good or bad:
            last_arrival = time.monotonic()
        elif time.monotonic() - last_arrival > timeout_s:
            raise NoData(f"no trajectory arrived for {timeout_s:.0f}s at version {version}: are "
                         "generators running (rollctl status)?")
        out.rejected += len(bad)
        admission.replace(len(bad))
        drop = []
        for entry_id, traj in good:
            oldest = min(int(s.token_versions.min()) for s in traj.samples)
            if traj.traj_id in seen:
                out.duplicate_ids.append(traj.traj_id)
                drop.append(entry_id)
            elif oldest < version - max_staleness:
                out.stale_ids.append(traj.traj_id)
                admission.replace(1)
                drop.append(entry_id)
            else:
                seen.add(traj.traj_id)
                out.groups.append(traj)
                out.entry_ids.append(entry_id)
                out.staleness[version - oldest] += 1
        broker.ack_trajectories(drop)
    out.wait_s = time.monotonic() - started
    return out
