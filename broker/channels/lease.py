"""One learner per run: the run's lease, and the writes it fences.

The lease is the hash `rl:{run}:lease` (token, host, pid, since) with a TTL of `ttl_s`. A learner
takes it before it writes anything (`take`): when another learner holds it, `LeaseHeld` names
that learner and the new one stops at once, having written nothing. The holder keeps it alive
(`renew`, from its step loop and from a keeper thread every ttl/3, so that a long step or
checkpoint does not let it lapse) and gives it back at the end (`release`).

Fencing: every write only the learner may make goes through a Redis function that first checks
the token (broker/connect/functions.py: `fenced`, `issue`, `reissue`, `check_stream`, `admit`,
`quarantine`, `retire`), atomically with the write. A learner whose lease was taken over, or
expired while it could not reach Redis, gets `LeaseLost` from its next fenced write, which is
therefore not made. Files (checkpoints, weight versions, ledger lines) cannot be fenced inside
Redis: the learner runs `check` right before each becomes visible. A checked lease stays the
holder's for at least ttl_s, since nobody may take it before it expires except with
`take_over`, which is for an operator who knows the holder is dead.

Guarantee: without `take_over`, two learners never both make a fenced write to the run; a
learner that loses the lease makes no fenced write after the loss. Residual window: a process
stopped (SIGSTOP, a swap storm) for longer than ttl_s between a `check` and the file rename it
guards.

Release: a learner gives the lease back when it ends (`release`), and a process that took it
and exits without doing so (an error during start-up, a stop at once) gives it back at exit
(`atexit`), so the same command may start again at once; nothing can release the lease of a
process killed with SIGKILL except the one that started it and saw it die (`release_dead`:
`rollctl run` for its learner). Releasing never endangers the fencing: a write checks the token.

Everything goes through `RunLease`'s methods; a Sentinel failover (the replica promoted with the
lease key) keeps it, since the lease is an ordinary key replicated with the writes it fences.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from rollflash.broker.connect import functions
from rollflash.broker.connect.connection import BrokerUnavailable, ReconnectRetry
from rollflash.broker.connect.redis_io import RunMismatch, RunRedis, text

log = logging.getLogger(__name__)

Command = Sequence[Any]  # a Redis command and its arguments, e.g. ("XACK", key, group, id)


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    since: float  # time.time() when it took the lease

    @classmethod
    def here(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.time())

    def describe(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"host {self.host}, pid {self.pid}, since {stamp}"


def _holder(fields: Sequence[Any]) -> Holder:
    """From a function's reply (host, pid, since) or LEASELOST message words."""
    host, pid, since = (text(f) for f in fields)
    return Holder(host, int(pid) if pid.isdigit() else -1, float(since or 0) if since != "-" else 0)


class LeaseHeld(RunMismatch):
    """Another learner holds the run's lease."""


class LeaseLost(RunMismatch):
    """This learner's lease was taken over or expired: it must stop without writing."""


class RunLease:
    def __init__(self, io: RunRedis, ttl_s: float, token: str | None = None):
        self.io, self.key, self.ttl_ms = io, io.keys.lease, int(ttl_s * 1000)
        self.token = token  # set by `take`, or handed over by the learner's rank 0
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()

    def take(self, take_over: bool = False) -> None:
        """Take the lease, or raise `LeaseHeld` naming its holder (`take_over`: take it anyway)."""
        functions.load(self.io.client)
        me, token = Holder.here(), secrets.token_hex(16)
        args = [token, self.ttl_ms, me.host, me.pid, repr(me.since), "1" if take_over else "0"]
        reply = self.io.write(
            lambda: functions.fcall(self.io.client, "lease_take", [self.key], args)
        )
        if int(reply[0]) != 1:
            holder = _holder(reply[1:])
            raise LeaseHeld(
                f"run {self.io.keys.prefix} has a learner already ({holder.describe()}); this "
                f"one stops without writing anything. If that learner is dead, wait "
                f"{self.ttl_ms / 1000:.0f}s for its lease to expire, or start with --take-over"
            )
        if take_over:
            log.warning("took over the lease of run %s (--take-over)", self.io.keys.prefix)
        self.token = token
        atexit.register(self._release_at_exit)

    def holder_digest(self) -> str:
        """Who holds the lease, as the run hash may record it: a digest of the token (the token
        itself stays with the learner)."""
        assert self.token is not None, "take the lease first"
        return hashlib.sha256(self.token.encode()).hexdigest()[:16]

    def renew(self) -> None:
        """Extend the lease by ttl_s from now; `LeaseLost` if it is no longer ours."""
        reply = self.call("lease_renew", [], [self.ttl_ms])
        if int(reply[0]) != 1:
            raise self._lost(_holder(reply[1:]))

    check = renew  # before a file becomes visible: ours for at least ttl_s more

    def release(self) -> None:
        atexit.unregister(self._release_at_exit)
        self.stop_keeper()
        if self.token is not None:
            try:
                self.call("lease_release", [], [])
            except (RunMismatch, redis.RedisError, BrokerUnavailable) as e:  # it expires anyway
                log.warning("could not release the lease of %s: %s", self.io.keys.prefix, e)

    def _release_at_exit(self) -> None:
        """`release` as the process exits without having released: one quiet try (the lease
        expires by itself anyway)."""
        retry = self.io.client.get_retry()
        if isinstance(retry, ReconnectRetry):
            retry.timeout_s = 0.0  # a Redis that is gone is not waited for
        self._stop.set()  # not joined: a renewal under way may be waiting out Redis
        if self.token is not None:
            with contextlib.suppress(Exception):
                functions.fcall(self.io.client, "lease_release", [self.key], [self.token])

    def keep(self) -> None:
        """Renew from a daemon thread every ttl/3 until `release` (a long step, checkpoint or
        publish must not let the lease lapse); a loss is logged, and the next fenced write of
        the loop raises it."""

        def run() -> None:
            while not self._stop.wait(self.ttl_ms / 3000):
                try:
                    self.renew()
                except LeaseLost as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # Redis unreachable: the next renewal tries again
                    log.warning("could not renew the lease of %s: %s", self.io.keys.prefix, e)

        self._keeper = threading.Thread(target=run, name="lease", daemon=True)
        self._keeper.start()

    def stop_keeper(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)

    # --- fenced writes ------------------------------------------------------------------------
    def call(self, function: str, keys: list[str], args: list[Any], what: str = "") -> Any:
        """Run a library function that checks the token first (the lease key is put before
        `keys`, the token before `args`); `LeaseLost` if it is not ours. Refusals are retried
        (broker/connect/redis_io.py `write`)."""
        assert self.token is not None, "take the lease first"

        def run() -> Any:
            return functions.fcall(self.io.client, function, [self.key, *keys], [self.token, *args])

        try:
            return self.io.write(run, what or function, final=_final)
        except redis.ResponseError as e:
            if str(e).startswith("LEASELOST"):
                raise self._lost(_holder(str(e).split()[1:4])) from None
            if functions.missing(e):
                raise self.io.lost("the rollflash functions are gone") from None
            if str(e).startswith("NOSTREAM"):
                raise self.io.lost(f"the stream {str(e).split()[1]} is gone") from None
            raise

    def execute(self, commands: Sequence[Command], what: str = "") -> list[Any]:
        """Run `commands` in order, atomically, only while the lease is ours; their replies."""
        if not commands:
            return []
        args: list[Any] = []
        for command in commands:
            args += [len(command), *command]
        return list(self.call("fenced", [], args, what or str(commands[0][0]).lower()))

    def _lost(self, holder: Holder) -> LeaseLost:
        now = f"now held by {holder.describe()}" if holder.pid > 0 else "it expired"
        return LeaseLost(
            f"this learner lost the lease of run {self.io.keys.prefix} ({now}): another learner "
            "took the run over, so this one stops before its next write"
        )


def release_dead(io: RunRedis, pid: int, host: str | None = None) -> bool:
    """Free the run's lease if its holder is process `pid` on `host` (default: this one), which
    the caller knows is dead because it started it and saw it exit; True if it was freed. A lease
    another process took meanwhile is left alone."""
    functions.load(io.client)
    me = host if host is not None else socket.gethostname()
    freed = io.write(
        lambda: functions.fcall(io.client, "lease_release_dead", [io.keys.lease], [me, pid])
    )
    return int(freed) == 1


def _final(e: Exception) -> bool:
    """Errors a retry cannot cure: a lost lease, missing functions, a missing permission."""
    message = str(e)
    return (
        message.startswith(("LEASELOST", "NOPERM", "NOSTREAM"))
        or functions.missing(e)
        or isinstance(e, redis.exceptions.NoPermissionError)
    )
