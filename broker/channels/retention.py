"""Keeping Redis flat over a long run: what the learner trims, and when.

- Each generator's stream: below the learner group's oldest pending entry (its last delivered
  one when nothing is pending), checked and trimmed in one call (broker/channels/roster.py
  `check_streams`). An entry pending there is one a rank holds, or that a resumed learner
  re-reads; the checkpoint lists entry ids only to acknowledge them, which needs no data.
- `prompts`: below the oldest of: any prompt still in flight (`inflight`), the generators'
  oldest pending entry, and their group's last delivered entry. So no prompt is trimmed before it
  is claimed, answered and its answer used (or replaced), and what the loss auditor re-adds
  (prompts Redis forgot, broker/channels/audit.py) lies above it anyway.
- The dead letters (`dlq`, and each generator's `dlq:{id}`): their own retention, at most
  `max_entries` entries and none older than `max_age_s`. Only the learner trims them, and no
  generator can write to the learner's `dlq`.
The run hash, `dlq_reasons`, `inflight`, `generators` and the heartbeats stay bounded by
construction (counters, prompts in flight, generators alive).
"""

from __future__ import annotations

import logging
from typing import Any

from rollflash.broker.channels.lease import RunLease
from rollflash.broker.connect.keys import GEN_GROUP
from rollflash.broker.connect.redis_io import RunRedis, entry_key, text

log = logging.getLogger(__name__)

INTERVAL_S = 5.0  # how often rank 0 trims


class Retention:
    def __init__(self, io: RunRedis, lease: RunLease, max_entries: int, max_age_s: float):
        self.io, self.keys, self.lease = io, io.keys, lease
        self.max_entries, self.max_age_s = max_entries, max_age_s

    def prompts_floor(self) -> str | None:
        """The id below which every prompt entry may go (module docstring); None: nothing."""
        pipe = self.io.pipeline(transaction=True)
        pipe.hvals(self.keys.inflight)
        pipe.xpending(self.keys.prompts, GEN_GROUP)
        pipe.xinfo_groups(self.keys.prompts)
        inflight, pending, groups = pipe.execute(raise_on_error=False)
        groups = self.io.stream_reply(groups, self.keys.prompts)
        gen: Any = next((g for g in groups if text(g["name"]) == GEN_GROUP), None)
        if gen is None:
            raise self.io.lost(f"the consumer group {GEN_GROUP!r} of {self.keys.prompts} is gone")
        bounds = [text(gen["last-delivered-id"])] + [text(i) for i in inflight]
        if pending["pending"]:
            bounds.append(text(pending["min"]))
        floor = min(bounds, key=entry_key)
        return None if floor == "0-0" else floor

    def trim(self, generators: list[str]) -> None:
        """Trim the prompts and the dead letters (generators' streams: broker/channels/roster.py)."""
        commands: list[Any] = []
        floor = self.prompts_floor()
        if floor is not None:
            commands.append(("XTRIM", self.keys.prompts, "MINID", floor))
        now: Any = self.io.client.time()  # Redis's clock: the one that made the entry ids
        oldest = f"{int((now[0] + now[1] / 1e6 - self.max_age_s) * 1000)}-0"
        for dlq in [self.keys.dlq] + [self.keys.generator_dlq(g) for g in generators]:
            commands.append(("XTRIM", dlq, "MAXLEN", self.max_entries))
            commands.append(("XTRIM", dlq, "MINID", oldest))
        if commands:
            self.lease.execute(commands, "a trim")
