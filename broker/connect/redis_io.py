"""One run's Redis client as the broker's classes share it (registry, streams, audit): the run's
key names, the errors that say Redis lost the run, the policy for writes Redis refuses at
maxmemory, and the one place where redis-py's loosely typed replies become typed values.

Guarantees:
- Nothing here re-creates a run's keys once they are gone: a missing stream, consumer group or run
  hash raises `RunLost`, which names what is missing.
- Writes refused because Redis is at maxmemory (noeviction: "OOM ...") or busy (a long script,
  loading its data after a restart, a replica during a failover) are retried with backoff
  (broker/connect/retry.py) for `busy_timeout_s`, then raise `BrokerUnavailable`. Any other refusal is
  tried `REFUSED_ATTEMPTS` times in all, then raises `WriteRefused` naming the write and Redis's
  reason: one line for the user, never a traceback. A lost connection is the client's business
  (broker/connect/connection.py), not this module's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import redis
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from rollflash.broker.connect.connection import BrokerUnavailable
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.connect.retry import retry_until
from rollflash.errors import RollflashError

T = TypeVar("T")

Entry = tuple[str, dict[bytes, bytes]]  # a stream entry: its id and its raw fields


class RunMismatch(RollflashError, RuntimeError):
    """This process was started with a config or schema that differs from the run's."""


class RunLost(RunMismatch):
    """Redis no longer holds this run's state (it came back empty, or keys were deleted)."""


class WriteRefused(RunMismatch):
    """Redis kept refusing a write for a reason waiting does not cure (a permission, a key of
    the wrong type); the message names the write and the reason."""


REFUSED_ATTEMPTS = 3  # tries of a write Redis refuses for a reason other than memory or load
_BUSY = ("BUSY", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN")


def text(v: bytes | str) -> str:
    """A reply value as text (the client does not decode replies: fields hold raw bytes)."""
    return v.decode() if isinstance(v, bytes) else v


def wire(fields: Mapping[str, Any]) -> dict[FieldT, EncodableT]:
    """Stream entry or hash fields (str keys; str, int, float or bytes values) as the type
    redis-py's XADD and HSET declare."""
    return cast("dict[FieldT, EncodableT]", fields)


def opt_text(v: bytes | str | None) -> str | None:
    return None if v is None else text(v)


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable (milliseconds, sequence) pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def is_oom(e: Exception) -> bool:
    """Redis refused a write because it is at maxmemory (policy noeviction)."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or (
        isinstance(e, redis.ResponseError) and str(e).startswith("OOM")
    )


def is_busy(e: Exception) -> bool:
    """Redis refused a write it will take once it is less busy: maxmemory, a running script,
    loading its data, a replica that is not (yet) the primary."""
    # the error code exactly: BUSYGROUP (a group that exists) is not BUSY
    return is_oom(e) or (isinstance(e, redis.ResponseError) and str(e).split(" ", 1)[0] in _BUSY)


def _no_such_key(e: Exception) -> bool:
    return "no such key" in str(e).lower()


class RunRedis:
    """The client, the run's keys (`keys`), and typed access to what the broker reads."""

    def __init__(self, client: redis.Redis, run_id: str, busy_timeout_s: float = 60.0):
        self.client = client
        self.keys = RunKeys(run_id)
        self.busy_timeout_s = busy_timeout_s  # how long writes wait out Redis at maxmemory

    def lost(self, what: str) -> RunLost:
        """The error for a run whose `what` Redis no longer holds."""
        return RunLost(
            f"Redis no longer holds run {self.keys.prefix}: {what}; it restarted without its "
            "data (no AOF, another --dir) or was flushed. Nothing was re-created: restore Redis "
            "or start a new run (another run.run_id)"
        )

    def write(
        self,
        call: Callable[[], T],
        what: str = "a write",
        final: Callable[[Exception], bool] | None = None,
    ) -> T:
        """Run a write, waiting out refusals of a busy Redis (at maxmemory with noeviction,
        loading, ...) and trying other refusals `REFUSED_ATTEMPTS` times; `final(e)` says which
        errors no retry can cure (raised as they are)."""
        timeout_s = self.busy_timeout_s
        refusals = [0]

        def retry_if(e: Exception) -> bool:
            if is_busy(e):
                return True
            if not isinstance(e, redis.ResponseError) or (final is not None and final(e)):
                return False
            refusals[0] += 1
            if refusals[0] >= REFUSED_ATTEMPTS:
                raise WriteRefused(
                    f"Redis refused {what} of run {self.keys.prefix} {refusals[0]} times: {e}"
                ) from None
            return True

        def give_up(e: Exception, failures: int) -> Exception:
            if is_oom(e):
                return BrokerUnavailable(
                    f"Redis refused writes for {timeout_s:.0f}s because it is at "
                    "maxmemory: raise maxmemory or free memory"
                )
            return BrokerUnavailable(
                f"Redis refused writes for {timeout_s:.0f}s because it is busy ({str(e)[:80]})"
            )

        return retry_until(
            call,
            timeout_s=timeout_s,
            retry_if=retry_if,
            give_up=give_up,
            warn="Redis refused a write (%s); retrying it in %.1fs",
        )

    def pipeline(self, transaction: bool) -> Pipeline:
        return self.client.pipeline(transaction=transaction)

    # --- reads, typed ----------------------------------------------------------------------------
    def hash(self, key: str) -> dict[str, str]:
        raw: Any = self.client.hgetall(key)
        return {text(k): text(v) for k, v in raw.items()}

    def hget(self, key: str, field: str) -> str | None:
        reply: Any = self.client.hget(key, field)
        return opt_text(reply)

    def stream_reply(self, reply: Any, stream: str) -> Any:
        """A reply from a pipeline run with `raise_on_error=False`: `RunLost` if it says the
        stream is gone, any other error raised, else the reply."""
        if isinstance(reply, Exception):
            if _no_such_key(reply):
                raise self.lost(f"the stream {stream} is gone")
            raise reply
        return reply

    def stream_info(self, stream: str) -> dict[str, Any]:
        """XINFO STREAM (entries-added, last-generated-id, ...); `RunLost` if the stream is gone."""
        pipe = self.pipeline(transaction=False)
        pipe.xinfo_stream(stream)
        info: dict[str, Any] = self.stream_reply(pipe.execute(raise_on_error=False)[0], stream)
        return info

    @contextmanager
    def group_required(self, stream: str, group: str) -> Iterator[None]:
        """Turn Redis's NOGROUP (the group, or its stream, is gone) into `RunLost`."""
        try:
            yield
        except redis.ResponseError as e:
            if str(e).startswith("NOGROUP"):
                raise self.lost(f"the consumer group {group!r} of {stream} is gone") from None
            raise

    def read_group(
        self, group: str, consumer: str, stream: str, start: str, count: int, block_ms: int | None
    ) -> list[Entry]:
        """XREADGROUP on one stream; `RunLost` if the group is gone."""
        with self.group_required(stream, group):
            reply: Any = self.client.xreadgroup(
                group, consumer, {stream: start}, count=count, block=block_ms
            )
        return entries(reply[0][1] if reply else [])

    def autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, count: int
    ) -> list[Entry]:
        """XAUTOCLAIM from the start of the pending list; `RunLost` if the group is gone."""
        with self.group_required(stream, group):
            reply: Any = self.client.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id="0-0", count=count
            )
        return entries(reply[1])

    def xrange(self, stream: str, start: str, end: str, count: int | None = None) -> list[Entry]:
        return entries(self.client.xrange(stream, start, end, count=count))


def entries(raw: Any) -> list[Entry]:
    """Stream entries as redis-py returns them, with text ids (a deleted pending entry has no
    fields: it comes back with an empty dict)."""
    return [(text(entry_id), fields or {}) for entry_id, fields in raw]
