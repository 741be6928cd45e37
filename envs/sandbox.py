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
- the code travels over stdin (after it, `run(code, stdin)` sends the code's own input), the
  results over pipes, and the code's process holds no other descriptor (0 stdin, 1 stdout, 2
  stderr, 3 the state pipe): the caller never opens a path the sandbox can write. The files in
  /scratch persist from one call to the next of the same `Sandbox` as an archive held in the
  caller's memory (at most `disk_mb` plus STATE_SLACK for names; a larger one is dropped), which
  the next call unpacks inside the sandbox (the caller never interprets it); a call that is
  killed keeps the previous files.

A Python audit hook inside (envs/_sandbox_child.py) is a second layer only. envs/_exchange.py
drives the processes: one per call here; for the `code` reward's Python tests a judge's and a
program's, talking through the caller (envs/code_judge.py).

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
import platform
import shutil
import time

from rollflash.envs._bwrap import SandboxUnavailable
from rollflash.envs._cgroup import per_call_bound
from rollflash.envs._exchange import (
    STATE_SLACK,
    Exchange,
    SandboxError,
    SandboxLimits,
    SandboxResult,
)
from rollflash.envs._seccomp import supported_machine

__all__ = ["Sandbox", "SandboxError", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]
__all__ += ["STATE_SLACK", "describe_bound", "require_sandbox"]

log = logging.getLogger(__name__)


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

    def run(self, code: str, stdin: bytes = b"") -> SandboxResult:
        """Run `code` with `stdin` as its standard input (then its end)."""
        if self._closed:
            raise RuntimeError("sandbox used after close()")
        result, state = _call(self.limits, self.audit_hook, self._state, code, stdin)
        if state is not None:
            self._state = state
        return result

    def close(self) -> None:
        self._state, self._closed = b"", True


def _call(
    lim: SandboxLimits, audit_hook: bool, state: bytes, code: str, stdin: bytes = b""
) -> tuple[SandboxResult, bytes | None]:
    """One sandboxed run; returns the result and the new archive of /scratch (None: keep)."""
    deadline = time.monotonic() + lim.wall_s
    with Exchange() as ex:
        proc = ex.start(lim, code, audit_hook=audit_hook, state=state, stdin=stdin)
        if not ex.run(deadline):
            ex.time_out(proc)
        return ex.finish(proc), proc.archive
