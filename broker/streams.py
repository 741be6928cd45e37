"""The Redis side of a run: streams, consumer groups and the small hashes under `rl:{run_id}:`.

Delivery guarantees:
- A prompt entry is acknowledged by a generator in the same MULTI/EXEC transaction that adds its
  trajectory, so a group is never both lost and acknowledged. A generator that dies before that
  leaves the prompt pending; on restart it re-reads its own pending entries first, and any other
  generator takes it over (XAUTOCLAIM) once it has been idle for `rollout.reclaim_idle_s`.
- A trajectory entry is acknowledged by the learner only after the update that used it has been
  published (or after it was rejected), so a learner crash re-delivers it to the same consumer.
- Entries that fail to decode or validate are copied to `dlq` with the reason and their original
  id, then acknowledged: nothing is dropped silently and nothing poisons a reader twice.
Trajectories are at-least-once; the learner drops duplicates by `traj_id`.

Redis restarts (ARCHITECTURE.md, docs/faults.md):
- The client from broker.connection reconnects with backoff, so a restart only delays calls.
- Nothing here re-creates a run's keys after they are gone: XADD uses NOMKSTREAM, and a missing
  stream, consumer group or run hash raises `RunLost`, which names what is missing. Only the
  learner's start (`ensure_groups`, `register_run`) creates them.
- Redis with `appendfsync everysec` (or no fsync) may come back without its last writes. The
  learner's broker re-checks, at most once a second, that the prompts it added are still there
  (`verify_prompts`), re-adds the forgotten ones and counts them (`lost["prompts"]`, run hash
  `redis_lost_prompts`). A forgotten trajectory comes back by itself: its prompt's XACK was in the
  same transaction, so the prompt is pending again and is generated again. Two witnesses count
  it, each from its own side, so the same write may be counted by both (report both; never add
  them up):
  - its writer, if the same process is still alive, recognises the prompt when it comes back
    (`lost["trajectories"]`, heartbeat `redis_lost`). A writer that died or restarted cannot;
  - the learner's rank 0, whoever wrote it (`verify_trajectories`, at most once a second): it
    remembers the stream's `entries-added` and last id as it last saw them; Redis comes back with
    a prefix of its history, so once that id is gone, `entries-added` minus the entries after it
    is what Redis still holds of what the learner saw, and the difference is counted
    (`lost["trajectory_writes"]`, run hash `redis_lost_trajectory_writes`). `entries-added`
    alone would miss it once generators write again before the learner's next look.
  What neither counts as a Redis loss: a write added after the learner's last look (up to a
  second while it reads, a whole training step while it trains) whose writer also died or
  restarted; and what Redis forgot before a (re)started learner's first look. Such a write is
  still not silent: its prompt comes back to a generator as a re-delivered entry (own pending,
  or taken over), the new trajectory is marked `retried`, and the learner counts it (run hash
  `prompts_retried`), as it counts the prompts of a generator that died before answering.
  A forgotten weights announcement is made again (`verify_weights`): re-added prompts may name
  that version, and generators wait until the `weights` hash does.
- Writes refused because Redis is at maxmemory (noeviction: "OOM ...") are retried with backoff
  for `busy_timeout_s`, then raise `BrokerUnavailable`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis

from rollflash.broker.connection import BrokerUnavailable
from rollflash.broker.retry import retry_until
from rollflash.broker.schema import (
    SCHEMA_VERSION,
    PromptWork,
    Trajectory,
    WireError,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
)

log = logging.getLogger(__name__)

GEN_GROUP = "gen"
LEARNER_GROUP = "learner"
WATCH_INTERVAL_S = 1.0  # how often the learner's reads re-check that Redis still holds the run
RECENT_PROMPTS = 4096  # prompt entries the learner remembers, to re-add any Redis forgets
RECENT_COMPLETIONS = 65536  # prompts a generator remembers finishing, to spot forgotten ones
COUNT_CHUNK = 256  # entries per XRANGE when counting the trajectories added after a restart


class RunMismatch(RuntimeError):
    """This process was started with a config or schema that differs from the run's."""


class RunLost(RunMismatch):
    """Redis no longer holds this run's state (it came back empty, or keys were deleted)."""


def _lost(prefix: str, what: str) -> RunLost:
    return RunLost(
        f"Redis no longer holds run {prefix}: {what}; it restarted without its data "
        "(no AOF, another --dir) or was flushed. Nothing was re-created: restore Redis "
        "or start a new run (another run.run_id)"
    )


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def is_oom(e: Exception) -> bool:
    """Redis refused a write because it is at maxmemory (policy noeviction)."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or (
        isinstance(e, redis.ResponseError) and str(e).startswith("OOM")
    )


def _is_nogroup(e: redis.ResponseError) -> bool:
    return str(e).startswith("NOGROUP")


@dataclass
class Rejected:
    entry_id: str
    reason: str


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class RunBroker:
    def __init__(
        self, client: redis.Redis, run_id: str, max_payload_bytes: int, busy_timeout_s: float = 60.0
    ):
        self.r = client
        self.busy_timeout_s = busy_timeout_s  # how long writes wait out Redis at maxmemory
        self.prefix = f"rl:{run_id}:"
        self.max_payload_bytes = max_payload_bytes
        self.prompts = self.prefix + "prompts"
        self.trajectories = self.prefix + "trajectories"
        self.dlq = self.prefix + "dlq"
        self.weights_key = self.prefix + "weights"
        self.run_key = self.prefix + "run"
        self.lost: Counter = Counter()  # acknowledged writes Redis forgot: prompts, trajectories
        self.dead_lettered = 0  # entries this process sent to the dlq
        self._fingerprint: str | None = None  # set by the learner's register_run
        self._recent_prompts: deque[tuple[str, dict]] = deque(maxlen=RECENT_PROMPTS)
        self._last_issued: int | None = None
        self._completed: OrderedDict[tuple[str, int], None] = OrderedDict()
        # the learner's last look at the trajectories stream: (entries-added, last id)
        self._trajectory_writes: tuple[int, str] | None = None
        self._announced: dict | None = None  # the last weights this process announced
        self._next_watch = 0.0

    def _busy(self, write: Callable[[], Any]) -> Any:
        """Run a write, waiting out "OOM" refusals (Redis at maxmemory with noeviction)."""
        timeout_s = self.busy_timeout_s

        def give_up(e: Exception, failures: int) -> Exception:
            return BrokerUnavailable(
                f"Redis refused writes for {timeout_s:.0f}s because it is at "
                "maxmemory: raise maxmemory or free memory"
            )

        return retry_until(
            write,
            timeout_s=timeout_s,
            retry_if=is_oom,
            give_up=give_up,
            warn="Redis is at maxmemory (%s); retrying the write in %.1fs",
        )

    # --- set-up -------------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        for stream, group in ((self.prompts, GEN_GROUP), (self.trajectories, LEARNER_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def register_run(self, fingerprint: str) -> None:
        """Learner: record the run's config fingerprint, or refuse a run with another one."""
        self.r.hsetnx(self.run_key, "fingerprint", fingerprint)
        self.r.hsetnx(self.run_key, "schema", SCHEMA_VERSION)
        self._check_run(fingerprint)
        self._fingerprint = fingerprint

    def check_intact(self) -> None:
        """Raise `RunLost` naming what is missing unless Redis still holds the run hash (with
        this run's fingerprint), both streams and both consumer groups. Needs XINFO (the learner's
        ACL user; not the generator's). One round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.run_key, "fingerprint")
        pipe.xinfo_groups(self.prompts)
        pipe.xinfo_groups(self.trajectories)
        fingerprint, *groups = pipe.execute(raise_on_error=False)
        if fingerprint is None:
            raise _lost(self.prefix, f"the run hash {self.run_key} is gone")
        if self._fingerprint is not None and _text(fingerprint) != self._fingerprint:
            raise RunMismatch(
                f"run {self.prefix} now has config fingerprint {_text(fingerprint)}, "
                f"this learner registered {self._fingerprint}"
            )
        for stream, group, info in zip(
            (self.prompts, self.trajectories), (GEN_GROUP, LEARNER_GROUP), groups
        ):
            if isinstance(info, Exception):
                if "no such key" not in str(info).lower():
                    raise info
                raise _lost(self.prefix, f"the stream {stream} is gone")
            if group not in {_text(g["name"]) for g in info}:
                raise _lost(self.prefix, f"the consumer group {group!r} of {stream} is gone")

    def run_state(self) -> str | None:
        """The run's `state` field (None before training starts); raises `RunLost` when the run
        hash is gone. What a generator checks every turn (its ACL allows no XINFO)."""
        fields = self.run_fields()
        if "fingerprint" not in fields:
            raise _lost(self.prefix, f"the run hash {self.run_key} is gone")
        return fields.get("state")

    def join_run(self, fingerprint: str, timeout_s: float) -> None:
        """Generator: wait (read-only) for the learner to register the run, then check it."""
        deadline = time.monotonic() + timeout_s
        while self.r.hget(self.run_key, "fingerprint") is None:
            if time.monotonic() > deadline:
                raise RunMismatch(
                    f"run {self.prefix} was not started by a learner within "
                    f"{timeout_s:.0f}s: start the learner (rollctl start-learner)"
                )
            time.sleep(0.2)
        self._check_run(fingerprint)

    def _check_run(self, fingerprint: str) -> None:
        have = self.r.hmget(self.run_key, ["fingerprint", "schema"])
        if _text(have[1]) != str(SCHEMA_VERSION):
            raise RunMismatch(
                f"run {self.prefix} uses wire schema {_text(have[1])}, "
                f"this process speaks {SCHEMA_VERSION}"
            )
        if _text(have[0]) != fingerprint:
            raise RunMismatch(
                f"run {self.prefix} was started with config fingerprint "
                f"{_text(have[0])}, this process has {fingerprint}: use the same "
                "config file, or another run.run_id"
            )

    def set_run_fields(self, **fields: str | int | float) -> None:
        self._busy(lambda: self.r.hset(self.run_key, mapping=fields))

    def count_in_run(self, name: str, n: int) -> None:
        """Add `n` to the run hash's counter `name` (learner only: generators may not write it)."""
        self._busy(lambda: self.r.hincrby(self.run_key, name, n))

    def run_fields(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in self.r.hgetall(self.run_key).items()}

    # --- prompts --------------------------------------------------------------------------------
    def add_prompts(self, works: list[PromptWork], issued: int | None = None) -> None:
        """XADD the prompts; `issued` (the learner's new total) is recorded in the run hash in the
        same transaction, so Redis always holds the exact count a resumed learner continues."""
        self.verify_prompts()  # before our XADDs move the stream's last id past a lost tail
        entries = [encode_prompt(w) for w in works]
        ids = self._busy(lambda: self._xadd_prompts(entries, issued))
        self._recent_prompts.extend(zip(ids, entries))
        self._last_issued = issued if issued is not None else self._last_issued

    def _xadd_prompts(self, entries: list[dict], issued: int | None) -> list[str]:
        pipe = self.r.pipeline(transaction=True)
        for fields in entries:
            pipe.xadd(self.prompts, fields, nomkstream=True)
        if issued is not None:
            pipe.hset(self.run_key, "issued", issued)
        ids = pipe.execute()[: len(entries)]
        if any(i is None for i in ids):
            raise _lost(self.prefix, f"the stream {self.prompts} is gone")
        return [_text(i) for i in ids]

    def verify_prompts(self) -> int:
        """Learner: re-add prompts Redis acknowledged and then forgot (a restart with appendfsync
        everysec); returns how many. The learner is the only writer of the prompts stream, so
        any of our entries above the stream's last id is one Redis lost."""
        if not self._recent_prompts:
            return 0
        try:
            last = _text(self.r.xinfo_stream(self.prompts)["last-generated-id"])
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                raise _lost(self.prefix, f"the stream {self.prompts} is gone") from None
            raise
        if _entry_key(self._recent_prompts[-1][0]) <= _entry_key(last):
            return 0
        if _entry_key(self._recent_prompts[0][0]) > _entry_key(last):
            raise _lost(
                self.prefix,
                f"it forgot more than the last {RECENT_PROMPTS} prompts "
                f"(the stream ends at {last})",
            )
        kept = [(i, f) for i, f in self._recent_prompts if _entry_key(i) <= _entry_key(last)]
        forgotten = [f for i, f in self._recent_prompts if _entry_key(i) > _entry_key(last)]
        log.error(
            "Redis forgot %d prompts it had acknowledged (restart with appendfsync "
            "everysec?); adding them again",
            len(forgotten),
        )
        ids = self._busy(lambda: self._xadd_prompts(forgotten, self._last_issued))
        self._recent_prompts = deque(kept + list(zip(ids, forgotten)), maxlen=RECENT_PROMPTS)
        self.lost["prompts"] += len(forgotten)
        self._busy(lambda: self.r.hincrby(self.run_key, "redis_lost_prompts", len(forgotten)))
        return len(forgotten)

    def track_trajectory_writes(self) -> None:
        """Learner rank 0: from now on `verify_trajectories` counts trajectory writes Redis
        forgets. It starts from the stream as it is now: what Redis forgot before is not seen."""
        self._trajectory_writes = self._trajectories_look(None)[1:]

    def _trajectories_look(self, entry_id: str | None) -> tuple[bool, int, str]:
        """Whether `entry_id` (None: skip) is in the trajectories stream, its entries-added and
        last id; one round trip, so a restart cannot fall between the answers."""
        pipe = self.r.pipeline(transaction=False)
        if entry_id is not None:
            pipe.xrange(self.trajectories, entry_id, entry_id)
        pipe.xinfo_stream(self.trajectories)
        *found, info = pipe.execute(raise_on_error=False)
        if isinstance(info, Exception):
            if "no such key" not in str(info).lower():
                raise info
            raise _lost(self.prefix, f"the stream {self.trajectories} is gone")
        return (
            bool(found[0]) if found else True,
            int(info["entries-added"]),
            _text(info["last-generated-id"]),
        )

    def verify_trajectories(self) -> int:
        """Learner rank 0 (after `track_trajectory_writes`): count trajectory writes, by any
        generator, that Redis acknowledged and then forgot (a restart with appendfsync
        everysec); returns how many. Their prompts come back by themselves (module docstring).

        Redis comes back with a prefix of its history, so if the last entry we saw is still
        there nothing we saw was lost. If it is gone, every entry after it was added since the
        restart, so entries-added minus those entries is how many of the `seen` Redis kept."""
        if self._trajectory_writes is None:
            return 0
        seen, last = self._trajectory_writes
        still_there, added, now_last = self._trajectories_look(last if seen else None)
        forgotten = 0
        if not still_there:
            forgotten = max(0, seen - (added - self._count_between(last, now_last)))
        self._trajectory_writes = (added, now_last)
        if forgotten:
            log.error(
                "Redis forgot %d trajectory writes it had acknowledged (restart with "
                "appendfsync everysec?); their prompts are delivered and generated again",
                forgotten,
            )
            self.lost["trajectory_writes"] += forgotten
            self._busy(
                lambda: self.r.hincrby(self.run_key, "redis_lost_trajectory_writes", forgotten)
            )
        return forgotten

    def _count_between(self, after: str, upto: str) -> int:
        """Trajectory entries with ids in (after, upto]; only run after Redis forgot some."""
        n, start = 0, f"({after}"
        while True:
            chunk = self.r.xrange(self.trajectories, start, upto, count=COUNT_CHUNK)
            n += len(chunk)
            if len(chunk) < COUNT_CHUNK:
                return n
            start = f"({_text(chunk[-1][0])}"

    def watch(self) -> None:
        """Learner: at most every WATCH_INTERVAL_S, `check_intact`, `verify_prompts`,
        `verify_trajectories` and `verify_weights`."""
        if self._fingerprint is None or time.monotonic() < self._next_watch:
            return
        self._next_watch = time.monotonic() + WATCH_INTERVAL_S
        self.check_intact()
        self.verify_prompts()
        self.verify_trajectories()
        self.verify_weights()

    def claim_prompts(
        self, consumer: str, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[tuple[str, PromptWork]]:
        """Read up to `count` prompts for `consumer`, waiting up to `block_ms` (None: not at all;
        note that Redis reads BLOCK 0 as forever); `own_pending` re-reads unacked ones first."""
        start = "0" if own_pending else ">"
        try:
            reply = self.r.xreadgroup(
                GEN_GROUP,
                consumer,
                {self.prompts: start},
                count=count,
                block=None if own_pending else block_ms,
            )
        except redis.ResponseError as e:
            if _is_nogroup(e):
                raise _lost(
                    self.prefix, f"the consumer group {GEN_GROUP!r} of {self.prompts} is gone"
                ) from None
            raise
        return self._decode_prompts(reply[0][1] if reply else [], retried=own_pending)

    def _decode_prompts(self, entries: list, retried: bool) -> list[tuple[str, PromptWork]]:
        """`retried`: the entries were delivered before (own pending, taken over); the
        trajectories made from them say so, and the learner counts them."""
        out = []
        for entry_id, fields in entries:
            entry_id = _text(entry_id)
            if not fields:  # pending entry deleted meanwhile
                self.r.xack(self.prompts, GEN_GROUP, entry_id)
                continue
            try:
                work = decode_prompt(fields, self.max_payload_bytes)
            except WireError as e:
                self.dead_letter(self.prompts, GEN_GROUP, entry_id, str(e), fields)
                continue
            if (work.group_id, work.sample_index) in self._completed:
                # we added its trajectory and acknowledged it in one transaction: Redis forgot both
                self.lost["trajectories"] += 1
                log.error(
                    "Redis forgot the trajectory of %s/%d it had acknowledged (restart "
                    "with appendfsync everysec?); generating it again",
                    work.group_id,
                    work.sample_index,
                )
            out.append((entry_id, replace(work, retried=retried)))
        return out

    def reclaim_prompts(
        self, consumer: str, min_idle_ms: int, count: int
    ) -> list[tuple[str, PromptWork]]:
        """Take over prompts another generator claimed but has not finished for `min_idle_ms`
        (it probably died): XAUTOCLAIM moves them to `consumer`."""
        try:
            _, entries, _ = self.r.xautoclaim(
                self.prompts, GEN_GROUP, consumer, min_idle_ms, start_id="0-0", count=count
            )
        except redis.ResponseError as e:
            if _is_nogroup(e):
                raise _lost(
                    self.prefix, f"the consumer group {GEN_GROUP!r} of {self.prompts} is gone"
                ) from None
            raise
        return self._decode_prompts(entries, retried=True)

    # --- trajectories -----------------------------------------------------------------------------
    def add_trajectory(
        self, t: Trajectory, prompt_entry_id: str | None, sample_index: int = -1
    ) -> str:
        """XADD the trajectory and XACK its prompt atomically; returns the trajectory entry id.
        `sample_index` is the prompt's (replicated prompts), to recognise it if Redis forgets."""
        fields = encode_trajectory(t)

        def write() -> Any:
            pipe = self.r.pipeline(transaction=True)
            pipe.xadd(self.trajectories, fields, nomkstream=True)
            if prompt_entry_id is not None:
                pipe.xack(self.prompts, GEN_GROUP, prompt_entry_id)
            return pipe.execute()[0]

        entry_id = self._busy(write)
        if entry_id is None:
            raise _lost(self.prefix, f"the stream {self.trajectories} is gone")
        self._completed[(t.group_id, sample_index)] = None
        if len(self._completed) > RECENT_COMPLETIONS:
            self._completed.popitem(last=False)
        return _text(entry_id)

    def read_trajectories(
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
        start = after if own_pending else ">"
        self.watch()
        try:
            reply = self.r.xreadgroup(
                LEARNER_GROUP,
                consumer,
                {self.trajectories: start},
                count=count,
                block=None if own_pending else block_ms,
            )
        except redis.ResponseError as e:
            if _is_nogroup(e):
                raise _lost(
                    self.prefix,
                    f"the consumer group {LEARNER_GROUP!r} of {self.trajectories} is gone",
                ) from None
            raise
        good, bad = [], []
        for entry_id, fields in reply[0][1] if reply else []:
            entry_id = _text(entry_id)
            try:
                good.append(
                    (entry_id, decode_trajectory(fields or {}, self.max_payload_bytes, vocab_size))
                )
            except WireError as e:
                self.dead_letter(self.trajectories, LEARNER_GROUP, entry_id, str(e), fields or {})
                bad.append(Rejected(entry_id, str(e)))
        return good, bad

    def ack_trajectories(self, entry_ids: list[str], replaced: int = 0) -> None:
        """Acknowledge entries; `replaced` counts the groups among them that were dropped and
        must be replaced by fresh prompts. It is added to the run hash's `replaced` in the same
        transaction, so the admission count survives a learner crash exactly."""
        if not entry_ids and not replaced:
            return

        def write() -> None:
            pipe = self.r.pipeline(transaction=True)
            if entry_ids:
                pipe.xack(self.trajectories, LEARNER_GROUP, *entry_ids)
            if replaced:
                pipe.hincrby(self.run_key, "replaced", replaced)
            pipe.execute()

        self._busy(write)  # HINCRBY is refused at maxmemory

    def replaced_groups(self) -> int:
        """Groups the learner ranks dropped and asked to replace, over the run's life."""
        return int(self.r.hget(self.run_key, "replaced") or 0)

    def dead_letter(
        self, stream: str, group: str, entry_id: str, reason: str, fields: dict
    ) -> None:
        """Copy a rejected entry to the dlq with its reason, then acknowledge the original."""
        log.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
        entry = {"reason": reason, "source": stream, "original_id": entry_id}
        for k, v in fields.items():
            entry[f"orig_{_text(k)}"] = v if len(v) <= self.max_payload_bytes else b"<oversize>"

        def write() -> None:
            pipe = self.r.pipeline(transaction=True)
            pipe.xadd(self.dlq, entry, maxlen=100_000, approximate=True)
            pipe.xack(stream, group, entry_id)
            if group == LEARNER_GROUP:  # the learner replaces a rejected group with a fresh prompt
                pipe.hincrby(self.run_key, "replaced", 1)
            pipe.execute()

        self._busy(write)
        self.dead_lettered += 1

    # --- weights and liveness ---------------------------------------------------------------------
    def announce_weights(self, version: int, path: str, sha256: str, zmq_endpoint: str) -> None:
        self._announced = {
            "version": version,
            "path": path,
            "sha256": sha256,
            "published_at": time.time(),
            "zmq_endpoint": zmq_endpoint,
        }
        self._busy(lambda: self.r.hset(self.weights_key, mapping=self._announced))

    def verify_weights(self) -> bool:
        """Learner rank 0: announce the last published version again if Redis forgot it (a
        restart with appendfsync everysec): prompts re-added by `verify_prompts` may name it,
        and a generator waits for the hash to. Returns whether it had to."""
        if self._announced is None:
            return False
        have = _text(self.r.hget(self.weights_key, "version"))
        if have is not None and int(have) >= self._announced["version"]:
            return False
        log.error(
            "Redis forgot that weights v%d were published (it says v%s); announcing them again",
            self._announced["version"],
            have,
        )
        self.lost["weights"] += 1
        self._busy(lambda: self.r.hset(self.weights_key, mapping=self._announced))
        return True

    def weights(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in self.r.hgetall(self.weights_key).items()}

    def heartbeat(self, generator_id: str, fields: dict, ttl_s: float) -> None:
        key = f"{self.prefix}gen:{generator_id}"

        def write() -> None:
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(key, mapping={**fields, "heartbeat_at": time.time()})
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.execute()

        self._busy(write)

    def live_generators(self) -> dict[str, dict[str, str]]:
        out = {}
        for key in self.r.scan_iter(match=f"{self.prefix}gen:*", count=100):
            fields = {_text(k): _text(v) for k, v in self.r.hgetall(key).items()}
            if fields:
                out[_text(key)[len(self.prefix) + 4 :]] = fields
        return out

    def loaded_versions(self) -> set[int]:
        """Versions live generators report as loaded; retention must keep these."""
        return {
            int(g["loaded_version"])
            for g in self.live_generators().values()
            if g.get("loaded_version", "").lstrip("-").isdigit()
        }
