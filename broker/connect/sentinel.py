"""Redis behind Sentinel: the master's address comes from the Sentinels, and a write counts only
once replicas hold it.

`redis.sentinel.hosts` names the Sentinels; each new connection asks them for the master of
`redis.sentinel.service` (redis-py's `Sentinel.master_for`). `redis.url` then gives only the
user, password, database and TLS settings of the master: its host and port are not used.
A connection to a master that died, or that was demoted to a replica (READONLY), fails; the
client's retry policy (broker/connect/connection.py) reconnects with backoff, asking the Sentinels again,
so a failover is waited out like a restart: within the Sentinels' failover time plus one backoff
step (at most 5 s) and `redis.connect_timeout_s` at the longest.

Replication is asynchronous: the master answers a write before any replica has it, and a
failover promotes a replica that may lack the last writes. So every write this client sends is
followed, on the same connection, by `WAIT redis.sentinel.replicas WAIT_TIMEOUT_MS`: the caller
gets the reply only once that many replicas acknowledged the write (and everything the master
applied before it). A shortfall (a replica down, this master cut off from its replicas, a
failover under way) raises `NotReplicated`, a connection error: the retry policy closes the
connection and sends the command again, to whichever master the Sentinels name by then. The write
may have landed once already: it is indeterminate, as after a lost reply, and the readers
de-duplicate it (trajectory ids; fenced learner functions check the lease and the run's state).
So a generator's XADD, the learner's issue of prompts, its ledger state and its XACK count only
once replicated, and the learner acknowledges a trajectory only after the writes it depends on
were.

WAIT does not close: a write the master applied but no replica holds when the master dies is
lost from Redis (its writer was not answered, and re-sends it or the learner re-issues it); and a
replica that holds a write may itself die before it is promoted (with `replicas: 1`, losing the
master and that replica together loses the write). See docs/faults.md.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline
from redis.connection import SSLConnection, parse_url
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from rollflash.broker.config.config_run import sentinel_address

WAIT_TIMEOUT_MS = 2000  # a healthy replica acknowledges within milliseconds

# Commands that change nothing a failover could lose, or that need no replica (XREADGROUP only
# moves entries into the pending list: a delivery lost with the master is delivered again, and
# the learner drops the repeat by traj_id). Everything else is followed by WAIT.
_NO_WAIT = frozenset(
    """PING ECHO AUTH HELLO SELECT CLIENT INFO TIME DBSIZE COMMAND CONFIG ACL MEMORY OBJECT TYPE
    EXISTS TTL PTTL GET MGET STRLEN HGET HMGET HGETALL HKEYS HVALS HLEN HEXISTS HSCAN SCAN KEYS
    SMEMBERS SISMEMBER SMISMEMBER SCARD SSCAN ZRANGE ZRANGEBYSCORE ZREVRANGE ZSCORE ZCARD ZCOUNT
    ZRANK LLEN LRANGE LINDEX XRANGE XREVRANGE XLEN XINFO XPENDING XREAD XREADGROUP FCALL_RO
    WAIT SUBSCRIBE PUBLISH""".split()
)


class NotReplicated(redis.ConnectionError):
    """Fewer replicas than `redis.sentinel.replicas` acknowledged a write within WAIT_TIMEOUT_MS."""


def needs_wait(command: Any) -> bool:
    name = command.decode() if isinstance(command, bytes) else str(command)
    return name.split()[0].upper() not in _NO_WAIT


def wait_for_replicas(conn: Any, replicas: int) -> None:
    """WAIT on `conn`, the connection that sent the write; `NotReplicated` on a shortfall."""
    conn.send_command("WAIT", replicas, WAIT_TIMEOUT_MS)
    acked = int(conn.read_response())
    if acked < replicas:
        raise NotReplicated(
            f"{acked} of {replicas} replicas acknowledged a write within {WAIT_TIMEOUT_MS} ms"
        )


class ReplicatedPipeline(Pipeline):
    """A pipeline or transaction followed by one WAIT when it holds a write."""

    replicas = 1

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: Any) -> Any:
        out = super()._execute_transaction(connection, commands, raise_on_error)
        if any(needs_wait(args[0]) for args, _ in commands):
            wait_for_replicas(connection, self.replicas)
        return out

    def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: Any) -> Any:
        out = super()._execute_pipeline(connection, commands, raise_on_error)
        if any(needs_wait(args[0]) for args, _ in commands):
            wait_for_replicas(connection, self.replicas)
        return out


class ReplicatedRedis(redis.Redis):
    """A client whose writes return only once `replicas` replicas hold them (module docstring)."""

    replicas = 1

    def _send_command_parse_response(
        self, conn: Any, command_name: Any, *args: Any, **options: Any
    ) -> Any:
        reply = super()._send_command_parse_response(conn, command_name, *args, **options)
        if needs_wait(command_name):
            wait_for_replicas(conn, self.replicas)
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        pipe = ReplicatedPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.replicas = self.replicas
        return pipe


class MasterConnection(SentinelManagedConnection):
    """A connection to the master that asks the Sentinels again whenever it reconnects.

    redis-py's Sentinel connection asks them in `connect()` only; a command re-sent on the same
    connection after its socket was lost reconnects through `connect_check_health`, straight to
    the last master's address, which after a failover is the dead one (every retry refused until
    the timeout). This routes that path through `connect()` too."""

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if retry_socket_connect and not self._sock:
            self.connect()  # asks the Sentinels, then comes back here with retry_socket_connect off
            return
        super().connect_check_health(check_health, retry_socket_connect)


class MasterSSLConnection(MasterConnection, SSLConnection):
    pass


class NewestSentinel(Sentinel):
    """Asks every Sentinel and believes the newest configuration (the highest config-epoch).

    redis-py's `Sentinel` takes the first Sentinel's answer. Right after a failover, a Sentinel
    that has not yet heard of it still names the old master, and once that node is back (a
    restarted process: empty, and a master until a Sentinel turns it into a replica), a client
    that believed it would write to, or read an empty run from, a node the failover left
    behind. A failover always raises the epoch, so the newest answer is the current master."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        best: tuple[int, tuple[str, int]] | None = None
        newest, errors = -1, []
        for sentinel in self.sentinels:
            try:
                masters: Any = sentinel.sentinel_masters()  # {name: state} on RESP2
                state = masters.get(service_name)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                errors.append(repr(e))
                continue
            if not state:
                continue
            epoch = int(state.get("config-epoch", 0))
            newest = max(newest, epoch)
            if self.check_master_state(state, service_name) and (best is None or epoch > best[0]):
                best = (epoch, (state["ip"], int(state["port"])))
        if best is None or best[0] < newest:  # the newest configuration's master is not up yet
            raise MasterNotFoundError(
                f"No master found for {service_name!r} (newest epoch {newest}) {errors}"
            )
        return best[1]


def _sentinels(hosts: list[str]) -> Sentinel:
    return NewestSentinel(
        [sentinel_address(h) for h in hosts],
        sentinel_kwargs={"socket_connect_timeout": 2, "socket_timeout": 2},
    )


def _node_options(url: str) -> dict[str, Any]:
    """The connection options of `url` without its address: user, password, db, TLS."""
    kwargs = parse_url(url)
    for key in ("host", "port", "path", "connection_class"):
        kwargs.pop(key, None)
    return kwargs


def replica_clients(url: str, hosts: list[str], service: str) -> list[redis.Redis]:
    """A plain client of each replica the Sentinels know for `service` (credentials of `url`)."""
    options = _node_options(url)
    ssl = options.pop("ssl", False)
    return [
        redis.Redis(host, port, ssl=ssl, socket_connect_timeout=5, **options)
        for host, port in _sentinels(hosts).discover_slaves(service)
    ]


def master_client(
    url: str, hosts: list[str], service: str, replicas: int, **options: Any
) -> ReplicatedRedis:
    """A client of the master the Sentinels `hosts` name for `service`, with the credentials, db
    and TLS of `url` (its host and port are not used); `options` go to every connection."""
    kwargs = _node_options(url)
    tls = kwargs.pop("ssl", False)  # rediss://
    client = _sentinels(hosts).master_for(
        service,
        redis_class=ReplicatedRedis,
        connection_class=MasterSSLConnection if tls else MasterConnection,
        **kwargs,
        **options,
    )
    assert isinstance(client, ReplicatedRedis)
    client.replicas = replicas
    return client
