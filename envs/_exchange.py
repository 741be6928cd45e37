"""Sandboxed processes running together under one loop: start each, feed its stdin, read its
stdout, stderr and state pipe, end it, and describe how it ended (envs/sandbox.py has the
guarantees of each process; this is how the caller drives them).

An `Exchange` holds the processes of one piece of work. A `Sandbox` call is one process whose
stdin is closed once its code (and any input) is sent; the `code` reward's Python tests are a
judge's process and a program's for each test, which the caller connects by relaying what one
writes on its stdout to the other's stdin (envs/code_judge.py). One thread runs the loop, so the
caller's callbacks need no locks; `run` returns at the deadline it is given, and the caller
decides which processes ran out of time (`time_out`).

Every process's stdout and stderr together are capped at `file_mb` (the process is killed
beyond, and the loop returns), or its stderr alone for a process the caller trusts to speak on
its stdout. Whatever happens, leaving the `with` block kills what is left, reaps it and removes
its cgroup.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollflash.envs._bwrap import Launched, kill_namespace, launch, runtime
from rollflash.envs._cgroup import CallGroup, per_call_bound

_CHUNK = 65536
_STDERR_TAIL = 65536  # the last bytes of stderr are kept: a traceback ends there
STATE_SLACK = 64 << 10  # bytes of names and framing an archive may add to disk_mb of files


class SandboxError(RuntimeError):
    """The sandbox itself failed to start a call (not the code's fault)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 5.0  # wall-clock seconds, then every process of the call is killed
    memory_mb: int = 256  # the call's memory (a cgroup) and each process's address space
    file_mb: int = 1  # largest file (RLIMIT_FSIZE), and stdout + stderr together
    disk_mb: int = 16  # size of the /scratch tmpfs, the only writable place
    nproc: int = 16  # processes of the call, the code's included (1 without a cgroup per call)
    max_output: int = 2000  # characters of stdout / error / stderr returned


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # the code ran to completion with exit status 0
    output: str  # stdout (at most max_output characters)
    error: str  # "" when ok, else a one-line reason
    wall_s: float
    stderr: str = ""  # the last max_output characters of stderr


@dataclass
class _Streams:
    out: bytearray = field(default_factory=bytearray)  # the first bytes of stdout
    err: bytearray = field(default_factory=bytearray)  # the last bytes of stderr
    state: bytearray = field(default_factory=bytearray)  # b"S" + length + archive of /scratch
    total: int = 0  # stdout + stderr bytes
    timed_out: bool = False
    flooded: bool = False  # stdout + stderr went past file_mb
    state_dropped: bool = False  # the archive went past disk_mb + STATE_SLACK: not kept


@dataclass(eq=False)
class Proc:
    """One sandboxed process of an exchange. `on_out(chunk)` gets its stdout as it comes (b""
    at its end); without it the first bytes are kept for the result."""

    lim: SandboxLimits
    launched: Launched
    group: CallGroup | None
    started: float
    on_out: Callable[[bytes], None] | None
    streams: _Streams = field(default_factory=_Streams)
    pending: bytearray = field(default_factory=bytearray)  # still to write on its stdin
    close_stdin: bool = False  # once `pending` is written
    stopped: bool = False  # killed by the caller, which no longer needs it
    cap_stdout: bool = True  # stdout counts towards file_mb (False: the caller's own process)
    open_fds: int = 3  # stdout, stderr and the state pipe not yet at their end
    result: SandboxResult | None = None
    archive: bytes | None = None  # /scratch as it reported it (None: keep the previous)

    @property
    def exited(self) -> bool:
        """Every process of its namespace has closed its pipes (so they have all ended)."""
        return self.open_fds == 0


class Exchange:
    """The processes of one piece of work and their deadline (module docstring)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self._sel = selectors.DefaultSelector()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for proc in self.procs:
                if proc.result is None:
                    self._end(proc, quiet=True)
        finally:
            self._sel.close()

    def start(
        self,
        lim: SandboxLimits,
        code: str,
        *,
        audit_hook: bool = True,
        state: bytes = b"",
        stdin: bytes = b"",
        keep_open: bool = False,
        on_out: Callable[[bytes], None] | None = None,
        cap_stdout: bool = True,
    ) -> Proc:
        """Start `code` in a fresh sandbox: /scratch restored from `state`, then `stdin` on its
        stdin, which is closed after it unless `keep_open` (then `send` writes more)."""
        bound = per_call_bound()
        try:  # the call's init and every process it starts (+1: the init itself)
            group = (
                None if bound.kind == "rlimits" else CallGroup(bound, lim.memory_mb, lim.nproc + 1)
            )
        except OSError as e:
            raise SandboxError(f"cannot make the call's cgroup: {e}") from None
        config = {
            "cpu_s": lim.cpu_s,
            "memory_mb": lim.memory_mb,
            "file_mb": lim.file_mb,
            "nproc": lim.nproc if group else 1,
            "audit_hook": audit_hook,
            "readable": list(runtime().stdlib),
        }
        started = time.monotonic()
        try:
            launched = launch(config, lim.disk_mb, group.attach if group else None)
        except BaseException:
            if group:
                group.close()
            raise
        proc = Proc(lim, launched, group, started, on_out, cap_stdout=cap_stdout)
        self.procs.append(proc)
        source = code.encode("utf-8", errors="replace")
        header = len(state).to_bytes(8, "little") + state + len(source).to_bytes(8, "little")
        pipes = launched.proc
        assert pipes.stdin is not None and pipes.stdout is not None and pipes.stderr is not None
        self._sel.register(pipes.stdout.fileno(), selectors.EVENT_READ, (proc, "out"))
        self._sel.register(pipes.stderr.fileno(), selectors.EVENT_READ, (proc, "err"))
        self._sel.register(launched.state_r, selectors.EVENT_READ, (proc, "state"))
        os.set_blocking(pipes.stdin.fileno(), False)
        self.send(proc, header + source + stdin)
        if not keep_open:
            self.end_input(proc)
        return proc

    def send(self, proc: Proc, data: bytes) -> None:
        """Queue `data` for `proc`'s stdin (written by `run`; dropped if it has closed it)."""
        stdin = proc.launched.proc.stdin
        if not data or stdin is None or stdin.closed or proc.close_stdin:
            return
        if not proc.pending:
            self._sel.register(stdin.fileno(), selectors.EVENT_WRITE, (proc, "in"))
        proc.pending += data

    def end_input(self, proc: Proc) -> None:
        """Close `proc`'s stdin once what is queued has been written."""
        proc.close_stdin = True
        if not proc.pending:
            self._close_stdin(proc)

    def stop(self, proc: Proc) -> None:
        """Kill `proc` now: the caller has what it needs from it."""
        proc.stopped = True
        kill_namespace(proc.launched.init)

    def time_out(self, proc: Proc) -> None:
        """Kill `proc` for running past its time, unless it has ended."""
        if not proc.exited and not proc.stopped:
            proc.streams.timed_out = True
            kill_namespace(proc.launched.init)

    def run(self, deadline: float, done: Callable[[], bool] = lambda: False) -> bool:
        """Pump every pipe until `done()`, every process has ended or one floods its output
        (True), or `deadline` passes (False)."""
        while self._sel.get_map() and not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self._sel.select(left):
                proc, what = key.data
                if what == "in":
                    self._write(proc, key.fd)
                elif not self._read(proc, what, key.fd):
                    return True  # flooded
        return True

    def finish(self, proc: Proc) -> SandboxResult:
        """`proc`'s result (after killing it if it still runs); raises SandboxError if the
        sandbox never started its code, unless the caller stopped it."""
        if proc.result is None:
            self._end(proc, quiet=False)
        assert proc.result is not None
        return proc.result

    # -- the loop's work -----------------------------------------------------------------------

    def _write(self, proc: Proc, fd: int) -> None:
        try:
            sent = os.write(fd, proc.pending[:_CHUNK])
        except BlockingIOError:
            return
        except BrokenPipeError:
            sent = len(proc.pending)
        del proc.pending[:sent]
        if not proc.pending:
            self._sel.unregister(fd)
            if proc.close_stdin:
                self._close_stdin(proc)

    def _close_stdin(self, proc: Proc) -> None:
        stdin = proc.launched.proc.stdin
        if stdin is not None and not stdin.closed:
            if proc.pending:
                self._sel.unregister(stdin.fileno())
                proc.pending.clear()
            stdin.close()

    def _read(self, proc: Proc, what: str, fd: int) -> bool:
        """Take one chunk; False if the process has now flooded its output."""
        s = proc.streams
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            self._sel.unregister(fd)
            proc.open_fds -= 1
            if what == "out" and proc.on_out is not None:
                proc.on_out(b"")
            return True
        if what == "state":
            max_state = 8 + (proc.lim.disk_mb << 20) + STATE_SLACK  # the files plus their names
            s.state_dropped |= len(s.state) + len(chunk) > max_state + 1
            if not s.state_dropped:
                s.state += chunk
            return True
        s.total += len(chunk) if what == "err" or proc.cap_stdout else 0
        if s.total > proc.lim.file_mb << 20:
            s.flooded = True
            return False
        if what == "err":
            s.err = (s.err + chunk)[-_STDERR_TAIL:]
        elif proc.on_out is not None:
            proc.on_out(chunk)
        else:  # bytes enough for max_output characters of UTF-8
            s.out += chunk[: 4 * proc.lim.max_output - len(s.out)]
        return True

    def _end(self, proc: Proc, quiet: bool) -> None:
        """Kill `proc` unless it has ended, reap it, release its descriptors and cgroup, and
        record its result."""
        s, launched = proc.streams, proc.launched
        try:
            try:
                if not proc.exited or s.timed_out or s.flooded or proc.stopped:
                    kill_namespace(launched.init)
                code = _reap(launched.proc)
            finally:
                for f in (launched.proc.stdin, launched.proc.stdout, launched.proc.stderr):
                    if f is not None:
                        if not f.closed and f.fileno() in self._sel.get_map():
                            self._sel.unregister(f.fileno())
                        f.close()
                if launched.state_r in self._sel.get_map():
                    self._sel.unregister(launched.state_r)
                for fd in (launched.state_r, launched.init):
                    if fd is not None:
                        os.close(fd)
            oom = proc.group.oom_kills() if proc.group else 0
        finally:
            if proc.group:
                proc.group.close()
        proc.result = _result(proc, code, oom, quiet or proc.stopped)
        proc.archive = None if s.state_dropped else _archive(bytes(s.state[1:]))


def _result(proc: Proc, code: int, oom: int, quiet: bool) -> SandboxResult:
    s, lim = proc.streams, proc.lim
    stderr = s.err.decode("utf-8", errors="replace")
    if not s.state.startswith(b"S") and not s.timed_out and not oom and not quiet:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        raise SandboxError(lines[-1] if lines else f"bwrap exited with status {code}")
    error = _reason(code, s, lim, stderr, oom)[: lim.max_output]
    return SandboxResult(
        ok=not error,
        output=s.out.decode("utf-8", errors="replace")[: lim.max_output],
        error=error,
        wall_s=round(time.monotonic() - proc.started, 3),
        stderr=stderr[-lim.max_output :],
    )


def _archive(reported: bytes) -> bytes | None:
    size = int.from_bytes(reported[:8], "little")
    return reported[8:] if len(reported) >= 8 and len(reported) == 8 + size else None


def _reap(proc: subprocess.Popen) -> int:
    """Wait for the bwrap launcher, which exits after the namespace's last process; its status is
    the code's (128 + N when killed by signal N)."""
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # never expected: the init was killed or has exited
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _reason(code: int, s: _Streams, lim: SandboxLimits, stderr: str, oom: int) -> str:
    if oom:  # first: a process the OOM killer ended may also have run the clock out
        return f"memory limit of {lim.memory_mb} MB exceeded"
    if s.timed_out:
        return f"timeout after {lim.wall_s:g}s wall clock"
    if s.flooded:
        return f"output limit of {lim.file_mb} MB exceeded"
    if code == 0:
        return ""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and not lines:
        return f"CPU time limit of {lim.cpu_s}s exceeded"
    if code == 128 + signal.SIGXFSZ:
        return f"file size limit of {lim.file_mb} MB exceeded"
    if lines:
        return lines[-1]  # the exception line of the traceback
    return f"exited with status {code}"
