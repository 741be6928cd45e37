"""A private redis-server for `rollctl run` and the test suites.

It listens on a unix socket only (`port 0`, no TCP) with mode 700, so no other machine and no other
user of this one can reach it (tests/integration/test_security.py checks that it opens no TCP
socket), and keeps no snapshot or AOF unless asked (`persistence`, `extra_args` such as
`--appendonly yes --appendfsync always`). The owner stops it with `stop()` or by using the object
as a context manager; `rollctl run` does so on Ctrl-C and at the end of training.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

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


class EmbeddedRedis:
    def __init__(
        self,
        workdir: str | Path | None = None,
        persistence: bool = False,
        extra_args: Sequence[str] = (),
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
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "redis.sock"
        if len(str(self.socket)) > 100:  # unix socket paths are limited to ~107 bytes
            self.socket = Path(tempfile.mkdtemp(prefix="rollredis-")) / "redis.sock"
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
        log_file = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            self._args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}"
                )
            try:
                redis.Redis(unix_socket_path=str(self.socket)).ping()
                return self
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer within {timeout_s}s")

    def stop(self) -> None:
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
