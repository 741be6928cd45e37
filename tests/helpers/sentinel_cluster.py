"""A Redis master, its replicas and three Sentinels, as real redis-server processes on loopback
TCP ports, for the Sentinel tests. The Sentinels judge a master down after DOWN_AFTER_MS and
retry a stalled failover after FAILOVER_TIMEOUT_MS, so that a failover takes seconds, not the
production default of a minute.

Redis ships Sentinel in redis-server itself (`redis-server FILE --sentinel`; Debian's
redis-sentinel package only adds a service and a symlink), so nothing beyond redis-server is
needed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

SERVICE = "rollflash"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


def free_port(taken: set[int]) -> int:
    """A port free now and not in `taken` (which it joins): the nodes bind only when started, so
    the kernel may hand out one port twice while choosing them."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


class PortTaken(RuntimeError):
    """A node's port was bound by another process between choosing it and starting the node."""


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Node:
    """One redis-server (data node or Sentinel) with its own directory and log."""

    def __init__(self, directory: Path, port: int, args: list[str]):
        self.dir, self.port, self.args = directory, port, args
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> Node:
        with open(self.dir / "redis.log", "ab") as log:
            self._log_from = log.tell()
            self.proc = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", *self.args, *extra],
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        _wait(self._answers, 10, f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        """True once this node's own process answers on its port (not another server there)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            with open(self.dir / "redis.log", "rb") as f:
                f.seek(self._log_from)
                log = f.read().decode(errors="replace")  # what this start wrote
            if "Address already in use" in log:
                raise PortTaken(f"port {self.port} is taken")
            raise AssertionError(f"redis-server on port {self.port} exited: {log[-1000:]}")
        return self.client().info("server")["process_id"] == self.proc.pid

    def client(self) -> redis.Redis:
        return redis.Redis("127.0.0.1", self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


class SentinelCluster:
    """`replicas` replicas of one master, watched by three Sentinels (quorum 2)."""

    def __init__(self, directory: Path, replicas: int = 1):
        self.dir, self.n = directory, replicas
        self._layout()

    def _layout(self) -> None:
        """Choose distinct ports and write each node's arguments or sentinel.conf."""
        data = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        data += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        taken: set[int] = set()
        port = free_port(taken)
        self.master = Node(self.dir / "master", port, ["--port", str(port), *data])
        self.replicas = []
        for i in range(self.n):
            p = free_port(taken)
            args = ["--port", str(p), *data, "--replicaof", "127.0.0.1", str(port)]
            self.replicas.append(Node(self.dir / f"replica-{i}", p, args))
        self.sentinels = []
        for i in range(3):
            p = free_port(taken)
            d = self.dir / f"sentinel-{i}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "sentinel.conf").write_text(
                f"port {p}\nbind 127.0.0.1\ndir {d}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(Node(d, p, [str(d / "sentinel.conf"), "--sentinel"]))

    @property
    def hosts(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def url(self) -> str:
        """A redis.url for the config: behind Sentinel, its host and port are not used."""
        return "redis://127.0.0.1:1/0"

    def start(self, attempts: int = 3) -> SentinelCluster:
        for attempt in range(attempts):
            try:
                for node in [self.master, *self.replicas, *self.sentinels]:
                    node.start()
                break
            except PortTaken:  # another process took a port meanwhile: choose them again
                self.stop()
                if attempt == attempts - 1:
                    raise
                self._layout()
        n = len(self.replicas)

        def ready() -> bool:  # every replica synced, every Sentinel knows them and the others
            info = self.master.client().info("replication")
            synced = sum(
                1 for k, v in info.items() if k.startswith("slave") and v["state"] == "online"
            )
            return synced == n and all(
                len(s.client().sentinel_slaves(SERVICE)) == n
                and len(s.client().sentinel_sentinels(SERVICE)) == 2
                for s in self.sentinels
            )

        _wait(ready, 60, "the replicas to sync and the Sentinels to find each other")
        return self

    def master_port(self) -> int:
        """The master's port as a majority of the Sentinels report it."""
        ports = []
        for s in self.sentinels:
            try:
                ports.append(int(s.client().sentinel_get_master_addr_by_name(SERVICE)[1]))
            except (redis.RedisError, TypeError):
                pass
        return max(set(ports), key=ports.count) if ports else -1

    def wait_promoted(self, timeout_s: float = 60) -> Node:
        """Until the Sentinels name one of the replicas the master and it answers as one."""
        found: list[Node] = []

        def promoted() -> bool:
            port = self.master_port()
            found[:] = [n for n in self.replicas if n.port == port]
            return bool(found) and found[0].client().info("replication")["role"] == "master"

        _wait(promoted, timeout_s, "the Sentinels to promote a replica")
        return found[0]

    def stop(self) -> None:
        for node in [*self.sentinels, *self.replicas, self.master]:
            node.stop()
