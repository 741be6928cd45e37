"""The prompts stream and the dead letters: `prompts` (the learner adds, the generators' group
`gen` claims), the learner's `dlq` (trajectory entries it rejected) and each generator's
`dlq:{id}` (prompt entries it rejected). The trajectory streams are in broker/channels/trajectories.py.

Delivery guarantees:
- The learner issues prompts with `issue`, a fenced function (broker/channels/lease.py): each entry is
  added with its traj_id recorded in `inflight` (traj_id -> entry id) and the new `issued` total
  in the run hash, atomically. `inflight` is what the learner checks for prompts whose answer
  never came (broker/channels/inflight.py), and what keeps the stream from being trimmed below a prompt
  still in flight (broker/channels/retention.py).
- A prompt entry is acknowledged by a generator in the function that adds its trajectory, after
  the XADD succeeded (broker/channels/trajectories.py), so a group is never both lost and acknowledged by
  an honest generator. A generator that dies before that leaves the prompt pending; on restart it
  re-reads its own pending entries first, and any other generator takes it over (XAUTOCLAIM) once
  it has been idle for `rollout.reclaim_idle_s`. Entries delivered before, or issued again by
  the learner (`reissued`), are marked `retried`, and so are the trajectories made from them:
  the learner counts those.
- A prompt entry a generator cannot decode is copied to its `dlq:{id}` with the reason and
  acknowledged, in one function call; the learner issues it again like any prompt answered with
  nothing it could use.
- A trajectory entry the learner rejects is copied to `dlq` with its reason, counted by code in
  `dlq_reasons` and acknowledged in one fenced call; if Redis keeps refusing the copy, it is
  acknowledged without one (counted `dlq_refused` in the run hash), so no entry poisons a reader
  twice and a broken dlq never stops the learner. Copied fields are cut at `DLQ_FIELD_BYTES`.
- XADD uses NOMKSTREAM and reads need the consumer group: a stream or group Redis no longer holds
  raises `RunLost` (broker/connect/redis_io.py), never re-creates it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from rollflash.broker.channels.lease import RunLease
from rollflash.broker.connect import functions
from rollflash.broker.connect.keys import GEN_GROUP
from rollflash.broker.connect.redis_io import Entry, RunRedis, WriteRefused, text
from rollflash.broker.wire.schema import PromptWork, WireError, decode_prompt, encode_prompt

log = logging.getLogger(__name__)

Claimed = list[tuple[str, PromptWork]]  # (prompt entry id, work)
Issued = tuple[str, dict[str, Any], str]  # (entry id, encoded fields, traj_id)
DLQ_FIELD_BYTES = 1 << 16  # a dead letter keeps each original field up to this size


def flat(fields: dict[str, Any]) -> list[Any]:
    """A field mapping as the argument list of an XADD inside a function."""
    return [x for kv in fields.items() for x in kv]


def traj_id_of(w: PromptWork) -> str:
    """The traj_id the answer to `w` will carry (schema.Trajectory.for_work)."""
    return w.group_id if w.sample_index < 0 else f"{w.group_id}/{w.sample_index}"


@dataclass
class Rejected:
    """A trajectory entry the learner refuses: dead-lettered with `error` once recorded."""

    ref: str  # "{generator}/{entry id}" (broker/channels/trajectories.py)
    error: WireError
    fields: dict[bytes, bytes] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        return str(self.error)


def dead_letter_entry(error: WireError, source: str, entry_id: str, fields: dict) -> dict:
    """The fields of a dead letter: reason, code, where it came from and its original fields."""
    entry: dict[str, Any] = {
        "reason": str(error),
        "code": error.code,
        "source": source,
        "original_id": entry_id,
    }
    for k, v in fields.items():
        if len(v) > DLQ_FIELD_BYTES:
            v = f"<{len(v)} bytes, sha256 {hashlib.sha256(v).hexdigest()[:16]}>".encode()
        entry[f"orig_{text(k)}"] = v
    return entry


class DeadLetters:
    """The learner's `dlq`: rejected trajectory entries with their reason."""

    def __init__(self, io: RunRedis, lease: RunLease):
        self.io, self.lease = io, lease

    def send(self, rejected: list[Rejected], ack: list[Any]) -> None:
        """Copy `rejected` to the dlq, count them by code and run `ack` (their XACKs), in one
        fenced call; without the copies if Redis keeps refusing them (module docstring)."""
        if not rejected:
            return
        keys = self.io.keys
        copies: list[Any] = []
        for r in rejected:
            gen, _, entry_id = r.ref.partition("/")
            log.warning("dead-lettering %s: %s", r.ref, r.reason)
            entry = dead_letter_entry(r.error, keys.trajectories(gen), entry_id, r.fields)
            copies.append(("XADD", keys.dlq, "NOMKSTREAM", "*", *flat(entry)))
            copies.append(("HINCRBY", keys.dlq_reasons, r.error.code, 1))
        try:
            self.lease.execute(copies + ack, "a dead letter")
        except WriteRefused as e:
            log.error("the dlq refuses dead letters (%s); acknowledging them without a copy", e)
            self.lease.execute([*ack, ("HINCRBY", keys.run, "dlq_refused", len(rejected))])


class PromptQueue:
    """The `prompts` stream: the learner issues work, the generators claim it."""

    def __init__(self, io: RunRedis, max_payload_bytes: int, lease: RunLease | None = None):
        self.io, self.keys, self.lease = io, io.keys, lease
        self.max_payload_bytes = max_payload_bytes
        self.dead_lettered = 0  # prompt entries this process sent to its dlq

    # --- the learner's side -----------------------------------------------------------------------
    def add(self, works: list[PromptWork], issued: int | None = None) -> list[Issued]:
        """Issue signed prompts; `issued` (the learner's new total) is recorded in the run hash
        in the same call, so Redis always holds the exact count a resumed learner continues."""
        entries = [(encode_prompt(w), traj_id_of(w)) for w in works]
        ids = self.add_encoded(entries, issued)
        return [(i, f, t) for i, (f, t) in zip(ids, entries)]

    def add_encoded(
        self, entries: list[tuple[dict[str, Any], str]], issued: int | None
    ) -> list[str]:
        """`add` for entries already encoded (prompts added again after Redis forgot them)."""
        assert self.lease is not None
        args: list[Any] = ["" if issued is None else issued]
        for fields, traj_id in entries:
            args += [traj_id, 2 * len(fields), *flat(fields)]
        keys = [self.keys.prompts, self.keys.inflight, self.keys.run]
        return [text(i) for i in self.lease.call("issue", keys, args, "prompt issue")]

    def reissue(self, pairs: list[tuple[str, str]], owner: str = "") -> list[str]:
        """Add (traj_id, prompt entry id) pairs again as new entries: those pending for `owner`
        (a quarantined generator; acknowledged for it), or with owner "" those acknowledged
        without an answer; the function skips any whose traj_id moved on. Returns the traj_ids
        issued again."""
        if not pairs:
            return []
        assert self.lease is not None
        args: list[Any] = [owner] + [x for pair in pairs for x in pair]
        keys = [self.keys.prompts, self.keys.inflight, self.keys.run]
        return [text(t) for t in self.lease.call("reissue", keys, args, "prompt reissue")]

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
        return self._decode(consumer, entries, retried=own_pending)

    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> Claimed:
        """Take over prompts another generator claimed but has not finished for `min_idle_ms`
        (it probably died): XAUTOCLAIM moves them to `consumer`."""
        entries = self.io.autoclaim(self.keys.prompts, GEN_GROUP, consumer, min_idle_ms, count)
        return self._decode(consumer, entries, retried=True)

    def _decode(self, consumer: str, entries: list[Entry], retried: bool) -> Claimed:
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
                self._dead_letter(consumer, entry_id, e, fields)
                continue
            out.append((entry_id, replace(work, retried=retried or work.reissued)))
        return out

    def _dead_letter(self, consumer: str, entry_id: str, e: WireError, fields: dict) -> None:
        """A generator's own dlq: the copy, then the prompt's acknowledgement."""
        log.warning("dead-lettering prompt %s: %s", entry_id, e)
        entry = dead_letter_entry(e, self.keys.prompts, entry_id, fields)
        stream = self.keys.generator_dlq(consumer)
        args = [entry_id, 2 * len(entry), *flat(entry)]
        self.io.write(
            lambda: functions.fcall(self.io.client, "publish", [stream, self.keys.prompts], args),
            f"a dead letter to {stream}",
        )
        self.dead_lettered += 1
