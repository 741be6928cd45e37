"""Each generator's trajectories stream `traj:{id}` (group `learner`): the generator adds its
finished groups, the learner ranks read every admitted generator's stream in one XREADGROUP.

Delivery guarantees:
- A generator adds trajectories with the `publish` function (broker/connect/functions.py): each XADD
  first, then the XACK of its prompt, so a prompt is acknowledged only once its trajectory is
  stored. A retried call (its reply lost with the connection, broker/connect/connection.py) may have run
  once already: trajectories are at-least-once and the learner drops duplicates by `traj_id`.
  Such calls are counted, per item, as `indeterminate` (`retried_items`).
- A trajectory entry is acknowledged by the learner only after the update that used it has been
  published (or after it was dropped or rejected), so a learner crash re-delivers it to the same
  consumer. An entry is named by a ref, `{generator}/{entry id}`.
- The learner accepts an entry only if it decodes within `WireLimits` and passes the provenance
  check (broker/channels/provenance.py); everything else comes back as `Rejected`, for the caller to
  record in its ledger and then dead-letter (broker/channels/streams.py `DeadLetters`).
- A group the learner is done with leaves `inflight`: a trained one when it is taken into a
  step (its entries stay pending until the checkpoint; a crash re-reads them), a dropped one
  (stale, filtered, late) in the call that acknowledges it, and so does a duplicate of one the
  rank does not hold; a rejected entry leaves its traj_id there, so a prompt whose only answer
  was unusable is issued again (broker/channels/inflight.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rollflash.broker.channels import provenance
from rollflash.broker.channels.lease import RunLease
from rollflash.broker.channels.streams import Rejected, flat
from rollflash.broker.connect import functions
from rollflash.broker.connect.keys import LEARNER_GROUP
from rollflash.broker.connect.redis_io import RunRedis, entries, text
from rollflash.broker.wire.schema import Trajectory, WireError, decode_trajectory, encode_trajectory
from rollflash.broker.wire.wire import WireLimits

Good = list[tuple[str, Trajectory]]  # (ref, trajectory)


def ref(generator: str, entry_id: str) -> str:
    return f"{generator}/{entry_id}"


def split_ref(r: str) -> tuple[str, str]:
    generator, _, entry_id = r.partition("/")
    return generator, entry_id


class GeneratorStream:
    """One generator's writing side of its own stream."""

    def __init__(self, io: RunRedis, generator_id: str):
        self.io, self.keys, self.id = io, io.keys, generator_id
        self.stream = io.keys.trajectories(generator_id)
        retry = getattr(io.client, "get_retry", lambda: None)()
        self._retry = retry if hasattr(retry, "failures") else None  # broker/connect/connection.py
        self.acknowledged = 0  # items whose call came back
        self.retried_items = 0  # items of calls re-sent after a lost connection: indeterminate

    def publish(self, items: list[tuple[Trajectory, str | None]]) -> list[str]:
        """XADD each trajectory, then XACK its prompt entry (if any); returns the entry ids."""
        args: list[Any] = []
        for t, prompt_entry_id in items:
            fields = encode_trajectory(t)
            args += [prompt_entry_id or "", 2 * len(fields), *flat(fields)]
        keys = [self.stream, self.keys.prompts]
        before = self._retry.failures if self._retry is not None else 0

        def call() -> Any:
            return functions.fcall(self.io.client, "publish", keys, args)

        try:
            ids = self.io.write(call, f"a trajectory to {self.stream}", final=_final)
        except Exception as e:
            if str(e).startswith("NOSTREAM"):
                raise self.io.lost(f"the stream {self.stream} is gone") from None
            if functions.missing(e):
                raise self.io.lost("the rollflash functions are gone") from None
            raise
        finally:
            if self._retry is not None and self._retry.failures > before:
                self.retried_items += len(items)
        self.acknowledged += len(items)
        return [text(i) for i in ids]


def _final(e: Exception) -> bool:
    return str(e).startswith(("NOSTREAM", "NOPERM")) or functions.missing(e)


class TrajectoryReader:
    """The learner's side of every generator's stream."""

    def __init__(self, io: RunRedis, lease: RunLease, limits: WireLimits, mac_key: bytes):
        self.io, self.keys, self.lease = io, io.keys, lease
        self.limits = limits  # what the learner accepts (the vocabulary is given per read)
        self.mac_key = mac_key

    def read(
        self,
        consumer: str,
        generators: list[str],
        count: int,
        block_ms: int | None,
        check: tuple[int, int, int],
        after: dict[str, str] | None = None,
    ) -> tuple[Good, list[Rejected]]:
        """Read from every generator's stream at once; `check` = (vocab_size, group size, the
        learner's version). `after` re-reads this consumer's pending entries with ids above
        each generator's given id (all of them for a generator not named)."""
        if not generators:
            return [], []
        streams: dict[Any, Any] = {
            self.keys.trajectories(g): (">" if after is None else after.get(g, "0"))
            for g in generators
        }
        with self.io.group_required(next(iter(streams)), LEARNER_GROUP):
            reply: Any = self.io.client.xreadgroup(
                LEARNER_GROUP, consumer, streams, count=count, block=block_ms
            )
        vocab, group_size, version = check
        limits = replace(self.limits, vocab_size=vocab)
        good: Good = []
        bad: list[Rejected] = []
        for stream, raw in reply or []:
            generator = self.keys.generator_of(text(stream))
            for entry_id, fields in entries(raw):
                r = ref(generator, entry_id)
                if not fields:  # pending, but gone from the stream: its generator trimmed it
                    bad.append(Rejected(r, WireError("entry deleted from its stream", "trimmed")))
                    continue
                try:
                    t = decode_trajectory(fields, limits)
                    provenance.check(self.mac_key, t, generator, group_size, version)
                except WireError as e:
                    bad.append(Rejected(r, e, fields))
                    continue
                good.append((r, t))
        return good, bad

    def acks(self, refs: Sequence[str]) -> list[Any]:
        """The XACK commands of `refs` (for a fenced call that does more)."""
        return [("XACK", s, LEARNER_GROUP, *ids) for s, ids in _by_stream(self.keys, refs).items()]

    def ack(self, refs: Sequence[str], finished: Sequence[str] = (), replaced: int = 0) -> int:
        """Acknowledge entries; `finished` traj_ids leave `inflight` and `replaced` (groups
        dropped, to be replaced by fresh prompts) is added to the run hash in the same call,
        only if an entry was still pending: so replaying an acknowledgement after a crash
        (learner/durability/ledger.py) never counts it twice. Returns how many entries were pending."""
        args: list[Any] = [replaced]
        by_stream = _by_stream(self.keys, refs)
        args.append(len(by_stream))
        for stream, ids in by_stream.items():
            args += [stream, len(ids), *ids]
        args += list(finished)
        keys = [self.keys.inflight, self.keys.run]
        return int(self.lease.call("settle", keys, args, "an acknowledgement"))


def _by_stream(keys: Any, refs: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in refs:
        generator, entry_id = split_ref(r)
        out.setdefault(keys.trajectories(generator), []).append(entry_id)
    return out
