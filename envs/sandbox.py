"""A Python sandbox for tool-using environments: run untrusted code, get its output or a clean error.

Each call writes the code to `main.py` in the sandbox's scratch directory and runs it in a fresh
interpreter (`python -I -S envs/_sandbox_child.py`) in its own session (process group), with:

- kernel limits set in the child before the code runs (`resource.setrlimit`): CPU seconds
  (RLIMIT_CPU, SIGXCPU/SIGKILL past it), address space (RLIMIT_AS: a huge allocation raises
  MemoryError), file size (RLIMIT_FSIZE, which also caps stdout/stderr: they go to files), processes
  (RLIMIT_NPROC, against fork bombs), 64 open files, no core dumps;
- a wall-clock limit enforced by the parent, which then SIGKILLs the whole process group (after a
  normal exit too, so nothing the code started survives it); if the parent itself dies (a
  generator killed with -9), the child gets SIGKILL too (prctl PR_SET_PDEATHSIG);
- no network: when the host allows unshare(2) (root, or unprivileged user namespaces), the child
  enters a new, empty network namespace, so a socket has no route anywhere. Otherwise (recorded as
  `network="audit-hook"` in the result) only the audit hook below blocks sockets;
- as root, the child drops to uid/gid 65534 (nobody) after the namespace is made: RLIMIT_NPROC only
  binds non-root users (not even root in a new user namespace: measured), and root-owned files and
  directories become read-only to the code. A few stdlib modules (`_sandbox_child.PRELOAD`: math,
  json, re, collections, ...) are imported before the drop, so they work even where the interpreter
  lives in a directory nobody cannot read (a pyenv Python under /root); other imports may then
  fail with ModuleNotFoundError, which is a clean error like any other;
- a Python audit hook (PEP 578) installed before the code runs, which refuses: opening for writing,
  listing, renaming or deleting any path outside the scratch directory; reading outside the scratch
  directory and the interpreter's own library directories; fork/exec/subprocess/os.system; sockets;
  ctypes; signals to other processes; changing the rlimits.

Honest limits: the audit hook is a Python-level barrier. It cannot be removed from Python code and
ctypes is refused, but a bug in a C extension module that the stdlib ships could in principle be
used to reach raw syscalls; then the kernel-level layers remain (rlimits, the process group kill,
the network namespace where available, and, as root, the unprivileged uid, which can still read
world-readable files and write world-writable directories such as /tmp). There is no seccomp filter
and no mount namespace. Do not run the sandbox on a machine whose world-readable files are secret.

A result is never an exception: `SandboxResult(ok, output, error)`, where `error` is a one-line
reason ("timeout after 2.0s", "memory limit", "MemoryError: ...", "PermissionError: sandbox: ...").
Stdlib only.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_CHILD = Path(__file__).with_name("_sandbox_child.py")
NOBODY = 65534


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 5.0  # wall-clock seconds, then the process group is killed
    memory_mb: int = 256  # address space (RLIMIT_AS)
    file_mb: int = 1  # largest file the code may write, stdout and stderr included (RLIMIT_FSIZE)
    nproc: int = 16  # processes of the sandbox user (RLIMIT_NPROC; the child itself is one)
    max_output: int = 2000  # characters of stdout / error returned
    isolate_network: bool = True  # try a fresh network namespace (unshare)


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # the code ran to completion with exit status 0
    output: str  # stdout (at most max_output characters)
    error: str  # "" when ok, else a one-line reason
    network: str  # "namespace" or "audit-hook": how the network was cut off
    wall_s: float


class Sandbox:
    """A scratch directory plus `run(code)`; files written by one call are visible to the next.
    `close()` removes the directory."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), audit_hook: bool = True) -> None:
        """audit_hook=False leaves out the Python-level layer: only for tests that check the
        kernel-level layers (rlimits, namespace, process-group kill) on their own."""
        self.limits, self.audit_hook = limits, audit_hook
        self.scratch = Path(tempfile.mkdtemp(prefix="rollflash-sandbox-"))
        if os.geteuid() == 0:
            os.chown(self.scratch, NOBODY, NOBODY)  # the child runs as nobody

    def run(self, code: str) -> SandboxResult:
        if not self.scratch.is_dir():
            raise RuntimeError("sandbox used after close()")
        lim = self.limits
        (self.scratch / "main.py").write_text(code)
        cfg = {
            "scratch": str(self.scratch),
            "cpu_s": lim.cpu_s,
            "memory_mb": lim.memory_mb,
            "file_mb": lim.file_mb,
            "nproc": lim.nproc,
            "isolate_network": lim.isolate_network,
            "audit_hook": self.audit_hook,
        }
        with tempfile.TemporaryDirectory(prefix="rollflash-sandbox-io-") as io_dir:
            out_path, err_path = Path(io_dir) / "out", Path(io_dir) / "err"
            started = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_CHILD), json.dumps(cfg)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=self.scratch,
                    env={"PATH": "/usr/bin:/bin"},
                    start_new_session=True,
                    close_fds=True,
                )
                timed_out = False
                try:
                    proc.wait(timeout=lim.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                _kill_group(proc)
            wall = time.monotonic() - started
            stdout = _read_head(out_path, lim.max_output)
            stderr = _read_head(err_path, 64_000)
        network = (
            "namespace" if lim.isolate_network and network_namespace_available() else "audit-hook"
        )
        error = _reason(proc.returncode, timed_out, lim, stderr)
        return SandboxResult(
            ok=not error,
            output=stdout,
            error=error[: lim.max_output],
            network=network,
            wall_s=round(wall, 3),
        )

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether a child can enter a new network namespace here (probed once per process, with the
    same unshare(2) call the sandbox child makes)."""
    probe = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "flags = 0x40000000 if os.geteuid() == 0 else 0x50000000; "
        "raise SystemExit(0 if libc.unshare(flags) == 0 else 1)"
    )
    try:
        return (
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", probe], timeout=30, capture_output=True
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session (it is the group leader), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _reason(code: int, timed_out: bool, lim: SandboxLimits, stderr: str) -> str:
    if timed_out:
        return f"timeout after {lim.wall_s:g}s wall clock"
    if code == 0:
        return ""
    if code == -signal.SIGXCPU or code == -signal.SIGKILL and "Traceback" not in stderr:
        return f"CPU time limit of {lim.cpu_s}s exceeded"
    if code == -signal.SIGXFSZ:
        return f"output/file size limit of {lim.file_mb} MB exceeded"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if lines:
        return lines[-1].strip()  # the exception line of the traceback
    return f"exited with status {code}"
