"""The run's two streams and their dead letters: `prompts` (the learner adds, the generators'
group `gen` claims) and `trajectories` (the generators add, the learner's group `learner` reads).

Delivery guarantees:
- A prompt entry is acknowledged by a generator in the same MULTI/EXEC transaction that adds its
  trajectory (`TrajectoryStream.add`), so a group is never both lost and acknowledged. A generator
  that dies before that leaves the prompt pending; on restart it re-reads its own pending entries
  first, and any other generator takes it over (XAUTOCLAIM) once it has been idle for
  `rollout.reclaim_idle_s`. Entries delivered before are marked `retried`, and so are the
  trajectories made from them: the learner counts those.
- A trajectory entry is acknowledged by the learner only after the update that used it has been
  published (or after it was rejected), so a learner crash re-delivers it to the same consumer.
- Entries that fail to decode or validate are copied to `dlq` with the reason and their original
  id, then acknowledged, in one transaction: nothing is dropped silently and nothing poisons a
  reader twice.
Trajectories are at-least-once (a retried command may have run: broker/connection.py); the
learner drops duplicates by `traj_id`.
- XADD uses NOMKSTREAM and reads need the consumer group: a stream or group Redis no longer holds
  raises `RunLost` (broker/redis_io.py), never re-creates it.
- Every write rides out Redis at maxmemory for `busy_timeout_s` (broker/redis_io.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from rollflash.broker.keys import GEN_GROUP, LEARNER_GROUP
from rollflash.broker.redis_io import Entry, RunRedis, text, wire
from rollflash.broker.schema import (
    PromptWork,
    Trajectory,
    WireError,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
)
from rollflash.broker.wire import WireLimits

log = logging.getLogger(__name__)

Claimed = list[tuple[str, PromptWork]]  # (prompt entry id, work)


@dataclass
class Rejected:
    entry_id: str
    reason: str


class DeadLetters:
    """The `dlq` stream: rejected entries with their reason, kept for a person to inspect."""

    def __init__(self, io: RunRedis, max_payload_bytes: int):
        self.io, self.max_payload_bytes = io, max_payload_bytes
        self.count = 0  # entries this process sent to the dlq

    def send(
        self, stream: str, group: str, entry_id: str, error: WireError, fields: dict[bytes, bytes]
    ) -> None:
        """Copy a rejected entry to the dlq with its reason and reason code, count it by code in
        the `dlq_reasons` hash, and acknowledge the original, in one transaction."""
        reason = str(error)
        log.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
        entry: dict[str, Any] = {
            "reason": reason,
            "code": error.code,
            "source": stream,
            "original_id": entry_id,
        }
        for k, v in fields.items():
            entry[f"orig_{text(k)}"] = v if len(v) <= self.max_payload_bytes else b"<oversize>"

        def write() -> None:
            pipe = self.io.pipeline(transaction=True)
            pipe.xadd(self.io.keys.dlq, wire(entry), maxlen=100_000, approximate=True)
            pipe.xack(stream, group, entry_id)
            pipe.hincrby(self.io.keys.dlq_reasons, error.code, 1)
            if group == LEARNER_GROUP:  # the learner replaces a rejected group with a fresh prompt
                pipe.hincrby(self.io.keys.run, "replaced", 1)
            pipe.execute()

        self.io.write(write)
        self.count += 1


class PromptQueue:
    """The `prompts` stream: the learner adds work, the generators claim it."""

    def __init__(self, io: RunRedis, max_payload_bytes: int, dead_letters: DeadLetters):
        self.io, self.keys = io, io.keys
        self.max_payload_bytes = max_payload_bytes
        self.dead_letters = dead_letters

    # --- the learner's side -----------------------------------------------------------------------
    def add(
        self, works: list[PromptWork], issued: int | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """XADD the prompts; `issued` (the learner's new total) is recorded in the run hash in the
        same transaction, so Redis always holds the exact count a resumed learner continues.
        Returns each entry's id with its encoded fields."""
        entries = [encode_prompt(w) for w in works]
        return list(zip(self.add_encoded(entries, issued), entries))

    def add_encoded(self, entries: list[dict[str, Any]], issued: int | None) -> list[str]:
        """`add` for entries already encoded (prompts added again after Redis forgot them)."""

        def write() -> list[str]:
            pipe = self.io.pipeline(transaction=True)
            for fields in entries:
                pipe.xadd(self.keys.prompts, wire(fields), nomkstream=True)
            if issued is not None:
                pipe.hset(self.keys.run, "issued", issued)
            ids = pipe.execute()[: len(entries)]
            if any(i is None for i in ids):
                raise self.io.lost(f"the stream {self.keys.prompts} is gone")
            return [text(i) for i in ids]

        return self.io.write(write)

    def replaced_groups(self) -> int:
        """Groups the learner ranks dropped and asked to replace, over the run's life."""
        return int(self.io.hget(self.keys.run, "replaced") or 0)

    # --- the generators' side ---------------------------------------------------------------------
    def claim(
        self, consumer: str, count: int, block_ms: int | None, own_pending: bool = False
    ) -> Claimed:
        """Read up to `count` prompts for `consumer`, waiting up to `block_ms` (None: not at all;
        note that Redis reads BLOCK 0 as forever); `own_pending` re-reads unacked ones first."""
        entries = self.io.read_group(
            GEN_GROUP,
            consumer,
            self.keys.prompts,
            "0" if own_pending else ">",
            count,
            None if own_pending else block_ms,
        )
        return self._decode(entries, retried=own_pending)

    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> Claimed:
        """Take over prompts another generator claimed but has not finished for `min_idle_ms`
        (it probably died): XAUTOCLAIM moves them to `consumer`."""
        entries = self.io.autoclaim(self.keys.prompts, GEN_GROUP, consumer, min_idle_ms, count)
        return self._decode(entries, retried=True)

    def _decode(self, entries: list[Entry], retried: bool) -> Claimed:
        """`retried`: the entries were delivered before (own pending, taken over); the
        trajectories made from them say so, and the learner counts them."""
        out = []
        for entry_id, fields in entries:
            if not fields:  # pending entry deleted meanwhile
                self.io.client.xack(self.keys.prompts, GEN_GROUP, entry_id)
                continue
            try:
                work = decode_prompt(fields, self.max_payload_bytes)
            except WireError as e:
                self.dead_letters.send(self.keys.prompts, GEN_GROUP, entry_id, e, fields)
                continue
            out.append((entry_id, replace(work, retried=retried)))
        return out


class TrajectoryStream:
    """The `trajectories` stream: the generators add finished groups, the learner reads them."""

    def __init__(self, io: RunRedis, limits: WireLimits, dead_letters: DeadLetters):
        self.io, self.keys = io, io.keys
        self.limits = limits  # what the learner accepts (the vocabulary is given per read)
        self.dead_letters = dead_letters

    # --- the generators' side ---------------------------------------------------------------------
    def add(self, t: Trajectory, prompt_entry_id: str | None) -> str:
        """XADD the trajectory and XACK its prompt atomically; returns the trajectory entry id."""
        return self.add_many([(t, prompt_entry_id)])[0]

    def add_many(self, items: list[tuple[Trajectory, str | None]]) -> list[str]:
        """`add` for several trajectories in one transaction (one round trip): every XADD and
        its prompt's XACK happen together or not at all. Returns the entry ids, in order."""
        encoded = [(wire(encode_trajectory(t)), prompt_entry_id) for t, prompt_entry_id in items]

        def write() -> list[Any]:
            pipe = self.io.pipeline(transaction=True)
            for fields, prompt_entry_id in encoded:
                pipe.xadd(self.keys.trajectories, fields, nomkstream=True)
                if prompt_entry_id is not None:
                    pipe.xack(self.keys.prompts, GEN_GROUP, prompt_entry_id)
            return _xadd_replies(pipe.execute(), encoded)

        entry_ids = self.io.write(write)
        if any(entry_id is None for entry_id in entry_ids):
            raise self.io.lost(f"the stream {self.keys.trajectories} is gone")
        return [text(entry_id) for entry_id in entry_ids]

    # --- the learner's side -----------------------------------------------------------------------
    def read(
        self,
        consumer: str,
        count: int,
        block_ms: int,
        vocab_size: int,
        own_pending: bool = False,
        after: str = "0",
    ) -> tuple[list[tuple[str, Trajectory]], list[Rejected]]:
        """Read and validate; invalid entries are dead-lettered, acked, and returned as Rejected.
        `own_pending` re-reads this consumer's unacknowledged entries with ids above `after`."""
        entries = self.io.read_group(
            LEARNER_GROUP,
            consumer,
            self.keys.trajectories,
            after if own_pending else ">",
            count,
            None if own_pending else block_ms,
        )
        good, bad = [], []
        for entry_id, fields in entries:
            try:
                limits = replace(self.limits, vocab_size=vocab_size)
                good.append((entry_id, decode_trajectory(fields, limits)))
            except WireError as e:
                self.dead_letters.send(self.keys.trajectories, LEARNER_GROUP, entry_id, e, fields)
                bad.append(Rejected(entry_id, str(e)))
        return good, bad

    def ack(self, entry_ids: list[str], replaced: int = 0) -> None:
        """Acknowledge entries; `replaced` counts the groups among them that were dropped and
        must be replaced by fresh prompts. It is added to the run hash's `replaced` in the same
        transaction, so the admission count survives a learner crash exactly."""
        if not entry_ids and not replaced:
            return

        def write() -> None:
            pipe = self.io.pipeline(transaction=True)
            if entry_ids:
                pipe.xack(self.keys.trajectories, LEARNER_GROUP, *entry_ids)
            if replaced:
                pipe.hincrby(self.keys.run, "replaced", replaced)
            pipe.execute()

        self.io.write(write)  # HINCRBY is refused at maxmemory


def _xadd_replies(replies: list[Any], encoded: list[tuple[Any, str | None]]) -> list[Any]:
    """The XADD replies of a transaction that interleaves each XADD with an optional XACK."""
    out, i = [], 0
    for _, prompt_entry_id in encoded:
        out.append(replies[i])
        i += 1 if prompt_entry_id is None else 2
    return out
