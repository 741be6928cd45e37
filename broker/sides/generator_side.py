"""`GeneratorBroker`: what one generator does with Redis, and nothing a learner does (its ACL
user, broker/connect/acl.py, could not anyway).

Over one client it holds the run registry (broker/channels/registry.py: join the run, check it every turn,
read the weights hash, heartbeat), the claiming side of the prompts stream (broker/channels/streams.py),
the writing side of its own trajectories stream (broker/channels/trajectories.py: delivery guarantees),
and its memory of the prompts it finished (broker/channels/audit.py), which recognises one that comes back
because Redis forgot its trajectory and acknowledgement, and counts it in `lost["trajectories"]`.

Joining (broker/channels/roster.py): `join` waits for the learner's registration, writes the heartbeat,
adds the id to `joined` and waits until the learner admits it (`generators[id]` = `active`). A
generator the learner quarantined stops with `Quarantined` (checked every turn by `run_state`).
"""

from __future__ import annotations

import time
from collections import Counter

import redis

from rollflash.broker.channels.audit import CompletedPrompts
from rollflash.broker.channels.registry import Fields, RunRegistry
from rollflash.broker.channels.roster import ACTIVE
from rollflash.broker.channels.streams import PromptQueue
from rollflash.broker.channels.trajectories import GeneratorStream
from rollflash.broker.config.fingerprint import Fingerprint
from rollflash.broker.connect.keys import NAME_RULE, valid_name
from rollflash.broker.connect.redis_io import RunMismatch, RunRedis
from rollflash.broker.wire.schema import PromptWork, Trajectory


class Quarantined(RunMismatch):
    """The learner refuses this generator's entries."""


class GeneratorBroker:
    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        generator_id: str,
        max_payload_bytes: int,
        busy_timeout_s: float = 60.0,
    ):
        if not valid_name(generator_id):
            raise ValueError(f"generator id {generator_id[:80]!r}: use {NAME_RULE}")
        io = RunRedis(client, run_id, busy_timeout_s)
        self.io, self.keys, self.id = io, io.keys, generator_id
        self._registry = RunRegistry(io)
        self._prompts = PromptQueue(io, max_payload_bytes)
        self._stream = GeneratorStream(io, generator_id)
        self._completed = CompletedPrompts()
        self._ttl_s = 30.0  # of the status hash, as the last heartbeat set it

    @property
    def lost(self) -> Counter[str]:
        """Trajectories this process wrote that Redis forgot (`lost["trajectories"]`)."""
        return self._completed.lost

    @property
    def dead_lettered(self) -> int:
        """Prompt entries this process rejected to its dlq."""
        return self._prompts.dead_lettered

    @property
    def writes(self) -> dict[str, int]:
        """Trajectory writes: `acknowledged` (the call came back) and `indeterminate` (re-sent
        after a lost connection: stored once, twice, or not at all)."""
        s = self._stream
        return {"acknowledged": s.acknowledged, "indeterminate": s.retried_items}

    # --- the run --------------------------------------------------------------------------------
    def join_run(
        self,
        fingerprint: Fingerprint,
        timeout_s: float,
        beat: Fields | None = None,
        ttl_s: float = 30.0,
    ) -> None:
        """Wait for the learner to register the run (and check it), then to admit us."""
        self._registry.join(fingerprint, timeout_s)
        self.ask_to_join(beat or {}, ttl_s)
        self.wait_admitted(timeout_s, beat or {}, ttl_s)

    def ask_to_join(self, beat: Fields, ttl_s: float) -> None:
        """Beat (the learner admits only a generator with a heartbeat), then add our id to
        `joined`."""
        self.heartbeat(beat, ttl_s)
        self.io.write(lambda: self.io.client.sadd(self.keys.joined, self.id), "joining")

    def wait_admitted(
        self, timeout_s: float, beat: Fields | None = None, ttl_s: float = 30.0
    ) -> None:
        """Wait for our admission. The learner admits within a second once its loop runs (the
        run's `state` is set), so the wait is bounded by `timeout_s` from then; before that the
        learner is starting (its model, version 0, the first evaluation), however long it takes.
        With `beat`, the heartbeat is renewed meanwhile (only a generator with one is admitted).
        """
        deadline = None
        next_beat = time.monotonic() + ttl_s / 3
        while (status := self.status()) != ACTIVE:
            if status is not None:
                raise self._quarantined(status)
            now = time.monotonic()
            if beat is not None and now >= next_beat:
                self.heartbeat(beat, ttl_s)
                next_beat = now + ttl_s / 3
            if deadline is None and self.run_state() is not None:
                deadline = now + timeout_s
            if deadline is not None and now > deadline:
                raise RunMismatch(
                    f"run {self.keys.prefix}: the learner did not admit generator {self.id} "
                    f"within {timeout_s:.0f}s: is the learner running (rollctl status)?"
                )
            time.sleep(0.2)

    def status(self) -> str | None:
        """`active`, `quarantined <reason>`, or None (not admitted)."""
        return self.io.hget(self.keys.generators, self.id)

    def run_state(self) -> str | None:
        """The run's `state` (None before training starts); raises `RunLost` if the run hash is
        gone and `Quarantined` if the learner refuses us."""
        state = self._registry.run_state()
        status = self.status()
        if status not in (ACTIVE, None):
            raise self._quarantined(status)
        return state

    def _quarantined(self, status: str) -> Quarantined:
        return Quarantined(
            f"generator {self.id} is {status} in run {self.keys.prefix}: the learner refuses its "
            "entries; start a generator under another --id (with its own ACL user: rollctl acl "
            "--generator ID)"
        )

    def weights(self) -> dict[str, str]:
        return self._registry.weights()

    def heartbeat(self, fields: Fields, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._registry.heartbeat(self.id, fields, ttl_s)

    def advertise(self, fields: dict[str, str]) -> None:
        """Write `fields` in this generator's status hash now, with the heartbeat's TTL: what
        only this generator's credentials can write (its weights key, broker/weights/weight_auth.py)."""
        self._registry.heartbeat(self.id, dict(fields), self._ttl_s)

    # --- prompts in, trajectories out -------------------------------------------------------------
    def claim_prompts(
        self, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[tuple[str, PromptWork]]:
        claimed = self._prompts.claim(self.id, count, block_ms, own_pending)
        self._completed.check(claimed)
        return claimed

    def reclaim_prompts(self, min_idle_ms: int, count: int) -> list[tuple[str, PromptWork]]:
        claimed = self._prompts.reclaim(self.id, min_idle_ms, count)
        self._completed.check(claimed)
        return claimed

    def add_trajectory(
        self, t: Trajectory, prompt_entry_id: str | None, sample_index: int = -1
    ) -> str:
        """XADD the trajectory, then XACK its prompt (one function call); returns the entry id.
        `sample_index` is the prompt's (replicated prompts), to recognise it if Redis forgets."""
        return self.add_trajectories([(t, prompt_entry_id, sample_index)])[0]

    def add_trajectories(self, items: list[tuple[Trajectory, str | None, int]]) -> list[str]:
        """`add_trajectory` for several (trajectory, prompt entry id, sample index) in one call,
        so one round trip to Redis; returns the trajectory entry ids in order."""
        entry_ids = self._stream.publish([(t, entry_id) for t, entry_id, _ in items])
        for t, _, sample_index in items:
            self._completed.finished(t.group_id, sample_index)
        return entry_ids
