"""`GeneratorBroker`: what a generator does with Redis, and nothing a learner does (its ACL user,
broker/acl.py, could not anyway).

Over one client it holds the run registry (broker/registry.py: join the run, check it every turn,
read the weights hash, heartbeat), the claiming side of the prompts stream and the writing side of
the trajectories stream (broker/streams.py: delivery guarantees), and its memory of the prompts it
finished (broker/audit.py), which recognises one that comes back because Redis forgot its
trajectory and acknowledgement, and counts it in `lost["trajectories"]`.
"""

from __future__ import annotations

from collections import Counter

import redis

from rollflash.broker.audit import CompletedPrompts
from rollflash.broker.fingerprint import Fingerprint
from rollflash.broker.redis_io import RunRedis
from rollflash.broker.registry import Fields, RunRegistry
from rollflash.broker.schema import PromptWork, Trajectory
from rollflash.broker.streams import DeadLetters, PromptQueue, TrajectoryStream
from rollflash.broker.wire import WireLimits


class GeneratorBroker:
    def __init__(
        self, client: redis.Redis, run_id: str, max_payload_bytes: int, busy_timeout_s: float = 60.0
    ):
        io = RunRedis(client, run_id, busy_timeout_s)
        self.keys = io.keys
        self._dead_letters = DeadLetters(io, max_payload_bytes)
        self._registry = RunRegistry(io)
        self._prompts = PromptQueue(io, max_payload_bytes, self._dead_letters)
        limits = WireLimits(max_bytes=max_payload_bytes)  # a generator only writes trajectories
        self._trajectories = TrajectoryStream(io, limits, self._dead_letters)
        self._completed = CompletedPrompts()

    @property
    def lost(self) -> Counter[str]:
        """Trajectories this process wrote that Redis forgot (`lost["trajectories"]`)."""
        return self._completed.lost

    @property
    def dead_lettered(self) -> int:
        """Prompt entries this process rejected to the dlq."""
        return self._dead_letters.count

    # --- the run --------------------------------------------------------------------------------
    def join_run(self, fingerprint: Fingerprint, timeout_s: float) -> None:
        self._registry.join(fingerprint, timeout_s)

    def run_state(self) -> str | None:
        return self._registry.run_state()

    def weights(self) -> dict[str, str]:
        return self._registry.weights()

    def heartbeat(self, generator_id: str, fields: Fields, ttl_s: float) -> None:
        self._registry.heartbeat(generator_id, fields, ttl_s)

    # --- prompts in, trajectories out -------------------------------------------------------------
    def claim_prompts(
        self, consumer: str, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[tuple[str, PromptWork]]:
        claimed = self._prompts.claim(consumer, count, block_ms, own_pending)
        self._completed.check(claimed)
        return claimed

    def reclaim_prompts(
        self, consumer: str, min_idle_ms: int, count: int
    ) -> list[tuple[str, PromptWork]]:
        claimed = self._prompts.reclaim(consumer, min_idle_ms, count)
        self._completed.check(claimed)
        return claimed

    def add_trajectory(
        self, t: Trajectory, prompt_entry_id: str | None, sample_index: int = -1
    ) -> str:
        """XADD the trajectory and XACK its prompt atomically; returns the trajectory entry id.
        `sample_index` is the prompt's (replicated prompts), to recognise it if Redis forgets."""
        return self.add_trajectories([(t, prompt_entry_id, sample_index)])[0]

    def add_trajectories(self, items: list[tuple[Trajectory, str | None, int]]) -> list[str]:
        """`add_trajectory` for several (trajectory, prompt entry id, sample index) in one
        transaction, so one round trip to Redis; returns the trajectory entry ids in order."""
        entry_ids = self._trajectories.add_many([(t, entry_id) for t, entry_id, _ in items])
        for t, _, sample_index in items:
            self._completed.finished(t.group_id, sample_index)
        return entry_ids
