"""A private redis-server for `rollctl run` and the test suites.

It listens on a unix socket only (`port 0`, no TCP) with mode 700, so no other machine and no other
user of this one can reach it (tests/integration/test_security.py checks that it opens no TCP
socket), and keeps no snapshot or AOF unless asked (`persistence`, `extra_args` such as
`--appendonly yes --appendfsync always`). The owner stops it with `stop()` or by using the object
as a context manager; `rollctl run` does so on Ctrl-C and at the end of training.

`snapshot=True` (`rollctl run`'s server) keeps the data of a clean stop for the next start: `stop()`
writes `dump.rdb` in the server's directory, and `start()` loads it and then deletes it, so that a
server that dies without a clean stop leaves no stale snapshot behind (the next start is empty, as
without a snapshot). `rollctl status`, `inspect` and `redis-cli` read a stopped run's snapshot
through a server of their own (`snapshot_reader`): a private socket, nothing written back.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from rollflash.broker.connect.secrets import private_subdir
from rollflash.errors import RollflashError


class RedisServerError(RollflashError, RuntimeError):
    pass


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn for child processes: the kernel sends `sig` when the parent exits (Linux), so
    even a `kill -9` of the parent leaves no orphan."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _own_group_dying_with_parent() -> None:
    """preexec_fn of the server: a process group of its own, so that a terminal's Ctrl-C (SIGINT
    to the foreground group) leaves it to its owner, who stops it last and, with `snapshot`,
    saves it first; and SIGTERM when the owner dies."""
    os.setpgid(0, 0)
    die_with_parent()


SNAPSHOT = "dump.rdb"  # what a server with `snapshot=True` writes at a clean stop


class EmbeddedRedis:
    def __init__(
        self,
        workdir: str | Path | None = None,
        persistence: bool = False,
        extra_args: Sequence[str] = (),
        snapshot: bool = False,
        private_socket: bool = False,
    ):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisServerError(
                "redis-server not found on PATH; install it (apt-get install "
                "redis-server) or pass --redis-url"
            )
        self._own_dir = workdir is None
        # absolute: redis-server chdirs to --dir before binding the socket path
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="rollredis-")).resolve()
        private_subdir(self.dir)
        self.snapshot = snapshot
        self.socket = self.dir / "redis.sock"
        self._socket_dir: Path | None = None  # a temporary directory of the socket, removed at stop
        if private_socket or len(str(self.socket)) > 100:  # socket paths have ~107 bytes at most
            self._socket_dir = Path(tempfile.mkdtemp(prefix="rollredis-"))
            self.socket = self._socket_dir / "redis.sock"
        args = [
            exe,
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.dir),
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
        ]
        if not persistence:
            args += ["--save", "", "--appendonly", "no"]
        self._args = args + list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.socket.parent.mkdir(mode=0o700, exist_ok=True)  # a private one, removed by `stop`
        log_file = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            self._args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_own_group_dying_with_parent,
        )
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}"
                )
            try:
                redis.Redis(unix_socket_path=str(self.socket)).ping()  # after loading any dump
                if self.snapshot:
                    (self.dir / SNAPSHOT).unlink(missing_ok=True)  # held in memory now
                return self
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer within {timeout_s}s")

    def stop(self) -> None:
        if self.snapshot and self.proc is not None and self.proc.poll() is None:
            try:  # SHUTDOWN SAVE: write dump.rdb, then exit
                redis.Redis(unix_socket_path=str(self.socket)).shutdown(save=True)
            except redis.RedisError:
                pass  # exited or could not save: terminated below, without a snapshot
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; its directory (and any AOF) stays for a restart
        with `start()`. For fault tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def snapshot_reader(directory: Path) -> EmbeddedRedis | None:
    """A server of its own on the snapshot a stopped `snapshot=True` server left in `directory`
    (None when there is none): on a private socket, saving nothing back. Start and stop it."""
    if not (directory / SNAPSHOT).is_file():
        return None
    return EmbeddedRedis(directory, private_socket=True)
