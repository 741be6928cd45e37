"""A Python sandbox for tool-using environments: run untrusted code, get its output or a clean error.

Each call runs the code in a fresh interpreter under bubblewrap (envs/_bwrap.py has the details):

- its own user, PID, mount, network, IPC and UTS namespaces: it sees no other process, has no
  network (not even the host's loopback), and its filesystem is a read-only root holding only
  the interpreter's binary, shared libraries and standard library, a private /proc, a minimal /dev,
  and `/scratch`, a tmpfs of `disk_mb`, the only writable place. No project files, no run
  directory, no site-packages, no /home, /etc or Redis socket exist in there;
- uid/gid 65534 with no capabilities (as root, also uid 65534 on the host);
- a seccomp filter (envs/_seccomp.py) refusing ptrace, mount, keyctl, bpf, unshare, setns, ...;
- rlimits set before the code runs (envs/_sandbox_child.py): CPU seconds, address space, file
  size, processes, 64 open files, no core dumps;
- a bound for the call as a whole (envs/_cgroup.py): a cgroup per call holding `memory_mb` and
  `nproc` for all the call's processes together where the host delegates one, else one process
  per call (RLIMIT_NPROC 1) under its RLIMIT_AS; `describe_bound()` says which;
- a wall-clock limit: then SIGKILL to the PID namespace's init, which kills every process the
  code started; the call returns only once they are all gone. The same happens when the caller
  dies (--die-with-parent), and every call ends its namespace, so nothing outlives a call;
- output capped: stdout and stderr together at `file_mb` (the process is killed beyond), of
  which `max_output` characters are returned;
- the code travels over stdin, the results over pipes, and the code's process holds no other
  descriptor (0 stdin, 1 stdout, 2 stderr, 3 the state pipe): the caller never opens a path the
  sandbox can write. The files in /scratch persist from one call to the next of the same
  `Sandbox` as an archive held in the caller's memory (at most `disk_mb` plus STATE_SLACK for
  names; a larger one is dropped), which the next call unpacks inside the sandbox (the caller
  never interprets it); a call that is killed keeps the previous files.

A Python audit hook inside (envs/_sandbox_child.py) is a second layer only.

There is no weaker fallback: if bubblewrap is missing or cannot create the namespaces, `Sandbox()`
raises `SandboxUnavailable` with one line saying what is missing and how to fix it. The threat
model and what is out of scope (kernel exploits, side channels) are in docs/security.md.

A call's result is never an exception: `SandboxResult(ok, output, error, stderr)`, where `error`
is a one-line reason ("timeout after 2s wall clock", "MemoryError", "memory limit of 256 MB
exceeded", "PermissionError: ..."). Only a failure of the sandbox itself to start raises
`SandboxError`. Stdlib only.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from rollflash.envs._bwrap import SandboxUnavailable, kill_namespace, launch, runtime
from rollflash.envs._cgroup import CallGroup, per_call_bound
from rollflash.envs._seccomp import supported_machine

__all__ = ["Sandbox", "SandboxError", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]
__all__ += ["describe_bound", "require_sandbox"]

log = logging.getLogger(__name__)

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


def require_sandbox() -> None:
    """Raise `SandboxUnavailable` (one line: what is missing, how to fix it) unless sandboxed
    calls work on this machine; probed once per process by running one."""
    problem = _probe()
    if problem:
        raise SandboxUnavailable(problem)


@functools.lru_cache(maxsize=1)
def _probe() -> str:
    if shutil.which("bwrap") is None:
        return (
            "the python tool runs code under bubblewrap, which is not installed: "
            "run 'make bwrap' (as root) or 'sudo apt-get install -y bubblewrap'"
        )
    if supported_machine() is None:
        return f"the python tool's sandbox has no seccomp filter for {platform.machine()}"
    try:
        result = _call(SandboxLimits(wall_s=60.0), True, b"", "print(6 * 7)")[0]
    except SandboxUnavailable as e:
        return str(e)
    except (SandboxError, OSError) as e:
        return (
            f"bubblewrap cannot start the python tool's sandbox here ({e}); it needs user "
            "namespaces: they always work as root, otherwise enable unprivileged ones "
            "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1, "
            "and on Ubuntu kernel.apparmor_restrict_unprivileged_userns = 0)"
        )
    if result.output != "42\n":
        return f"the python tool's sandbox failed its probe run: {result.error or result.output!r}"
    log.info(describe_bound())
    return ""


def describe_bound() -> str:
    """One line: how a call's memory and processes are bounded on this host (envs/_cgroup.py)."""
    return per_call_bound().describe()


class Sandbox:
    """`run(code)` calls share the files of /scratch; `close()` forgets them."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), audit_hook: bool = True) -> None:
        """audit_hook=False leaves out the Python-level layer: only for tests that check the
        kernel-level layers on their own."""
        require_sandbox()
        self.limits, self.audit_hook = limits, audit_hook
        self._state = b""  # /scratch as of the last call that ended cleanly (opaque here)
        self._closed = False

    def run(self, code: str) -> SandboxResult:
        if self._closed:
            raise RuntimeError("sandbox used after close()")
        result, state = _call(self.limits, self.audit_hook, self._state, code)
        if state is not None:
            self._state = state
        return result

    def close(self) -> None:
        self._state, self._closed = b"", True


@dataclass
class _Streams:
    out: bytearray = field(default_factory=bytearray)  # the first bytes of stdout
    err: bytearray = field(default_factory=bytearray)  # the last bytes of stderr
    state: bytearray = field(default_factory=bytearray)  # b"S" + length + archive of /scratch
    total: int = 0  # stdout + stderr bytes
    timed_out: bool = False
    flooded: bool = False  # stdout + stderr went past file_mb
    state_dropped: bool = False  # the archive went past disk_mb + STATE_SLACK: not kept


def _call(
    lim: SandboxLimits, audit_hook: bool, state: bytes, code: str
) -> tuple[SandboxResult, bytes | None]:
    """One sandboxed run; returns the result and the new archive of /scratch (None: keep)."""
    bound = per_call_bound()
    try:  # the call's init and every process it starts (+1: the init itself)
        group = None if bound.kind == "rlimits" else CallGroup(bound, lim.memory_mb, lim.nproc + 1)
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
    payload = len(state).to_bytes(8, "little") + state + code.encode("utf-8", errors="replace")
    started = time.monotonic()
    try:
        launched = launch(config, lim.disk_mb, group.attach if group else None)
        try:
            streams = _pump(launched, payload, started + lim.wall_s, lim)
            if streams.timed_out or streams.flooded:
                kill_namespace(launched.init)
            code_rc = _reap(launched.proc)
        finally:
            for f in (launched.proc.stdin, launched.proc.stdout, launched.proc.stderr):
                if f is not None:
                    f.close()
            for fd in (launched.state_r, launched.init):
                if fd is not None:
                    os.close(fd)
        oom = group.oom_kills() if group else 0
    finally:
        if group:
            group.close()
    wall = time.monotonic() - started
    stderr = streams.err.decode("utf-8", errors="replace")
    if not streams.state.startswith(b"S") and not streams.timed_out and not oom:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        raise SandboxError(lines[-1] if lines else f"bwrap exited with status {code_rc}")
    output = streams.out.decode("utf-8", errors="replace")[: lim.max_output]
    error = _reason(code_rc, streams, lim, stderr, oom)[: lim.max_output]
    result = SandboxResult(
        ok=not error,
        output=output,
        error=error,
        wall_s=round(wall, 3),
        stderr=stderr[-lim.max_output :],
    )
    return result, None if streams.state_dropped else _archive(bytes(streams.state[1:]))


def _archive(reported: bytes) -> bytes | None:
    size = int.from_bytes(reported[:8], "little")
    return reported[8:] if len(reported) >= 8 and len(reported) == 8 + size else None


def _pump(launched, payload: bytes, deadline: float, lim: SandboxLimits) -> _Streams:
    """Feed stdin and read stdout, stderr and the state pipe until all are closed (every process
    of the sandbox has exited), the deadline passes, or the output floods."""
    proc, s = launched.proc, _Streams()
    keep_out = 4 * lim.max_output  # bytes enough for max_output characters of UTF-8
    max_state = 8 + (lim.disk_mb << 20) + STATE_SLACK  # archive: the files plus their names
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
    for fd, what in ((proc.stdout.fileno(), "out"), (proc.stderr.fileno(), "err")):
        sel.register(fd, selectors.EVENT_READ, what)
    sel.register(launched.state_r, selectors.EVENT_READ, "state")
    sent = 0
    with sel:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                s.timed_out = True
                return s
            for key, _ in sel.select(left):
                if key.data == "in":
                    try:
                        sent += os.write(key.fd, payload[sent : sent + _CHUNK])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        sent = len(payload)
                    if sent >= len(payload):
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                elif key.data == "state":
                    s.state_dropped |= len(s.state) + len(chunk) > max_state + 1
                    if not s.state_dropped:
                        s.state += chunk
                else:
                    s.total += len(chunk)
                    if key.data == "out":
                        s.out += chunk[: keep_out - len(s.out)]
                    else:
                        s.err = (s.err + chunk)[-_STDERR_TAIL:]
                    if s.total > lim.file_mb << 20:
                        s.flooded = True
                        return s
    return s


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
