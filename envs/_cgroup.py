"""Per-call bounds of the Python sandbox: memory and processes held for a call as a whole.

An rlimit binds one process, and a call may start several: 16 processes of 256 MB of address
space each are 4 GB. So every call gets a bound for all its processes together, chosen once per
process (`per_call_bound`) and logged when the sandbox is first probed:

- `cgroup2`: a cgroup of the unified hierarchy per call, under the process's own cgroup, with
  `memory.max` = memory_mb, `memory.swap.max` = 0 and `pids.max`. A non-root cgroup cannot both
  hold processes and enable controllers for its children, so, as systemd's delegation rules ask,
  a process alone in a cgroup that offers memory and pids moves itself into a `leaf` child
  first and enables them for the others; a process that shares its cgroup cannot, and falls
  back;
- `cgroup1`: one cgroup per call in each of the v1 memory and pids hierarchies, under the
  process's own cgroups there (`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where
  swap is accounted; `pids.max`);
- `rlimits`: no cgroup can be made here (none delegated, not writable, or switched off with
  ROLLFLASH_SANDBOX_CGROUP=off): the call may hold one process (RLIMIT_NPROC 1: no fork, no
  thread), whose RLIMIT_AS is the call's memory.

With a cgroup the call's init (bwrap's reaper in the PID namespace) is placed in it while it
waits for the caller, before any of the code's processes exists, so all of them are inside; the
kernel's OOM killer acts within the cgroup, and `oom_kills` tells the caller it did. A cgroup is
removed when its call has ended; ones left by a process killed mid-call are removed by the next
process that starts (their names carry the pid). The memory a cgroup counts includes /scratch
(tmpfs pages are charged to the process that writes them).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PREFIX = "rollflash-sandbox"
OFF_ENV = "ROLLFLASH_SANDBOX_CGROUP"  # "off": never make cgroups (the rlimits bound)
_LEAF = f"{PREFIX}-leaf"  # cgroup v2: where a process that delegates to itself moves
_names = itertools.count()


@dataclass(frozen=True)
class CallBound:
    """How a call's memory and processes are bounded on this host."""

    kind: Literal["cgroup2", "cgroup1", "rlimits"]
    parents: tuple[str, ...] = ()  # directories the per-call cgroups are made in
    why: str = ""  # rlimits: why no cgroup is used

    def describe(self) -> str:
        """One line for the log: which bound is in force."""
        if self.kind == "rlimits":
            return (
                f"sandbox: no cgroup per call ({self.why}); each call is one process "
                "(RLIMIT_NPROC 1) bounded by RLIMIT_AS, RLIMIT_CPU and its /scratch size"
            )
        return (
            f"sandbox: each call runs in its own {self.kind} cgroup "
            f"(memory and processes of the call together) under {', '.join(self.parents)}"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Controller ("memory", "pids") or "" (the v2 hierarchy) -> (mount point, mount root)."""
    out: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup2":
            out.setdefault("", (fields[4], fields[3]))
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("memory", "pids"):
                    out.setdefault(option, (fields[4], fields[3]))
    return out


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller or "" (v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _directory(mount: tuple[str, str], path: str) -> Path:
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return Path(point + "/" + path.lstrip("/"))


def _sweep(parent: Path) -> None:
    """Remove per-call cgroups that processes killed mid-call left behind (empty by now)."""
    for entry in parent.glob(f"{PREFIX}-*-*"):
        pid = entry.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                entry.rmdir()
            except OSError:
                pass


def _probe(parents: list[Path], files: list[tuple[int, str, str]]) -> str:
    """Make, limit and remove one cgroup in each parent; "" if that works, else why not.
    `files`: (parent index, file, value) written in that order."""
    made: list[Path] = []
    try:
        for parent in parents:
            made.append(parent / f"{PREFIX}-{os.getpid()}-probe")
            made[-1].mkdir(exist_ok=True)
        for index, name, value in files:
            (made[index] / name).write_text(value)
        return ""
    except OSError as e:
        return f"{e.strerror or e} at {e.filename or parents[0]}"
    finally:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass


def _v1(mounts: dict, paths: dict) -> CallBound | str:
    if not {"memory", "pids"} <= mounts.keys() or not {"memory", "pids"} <= paths.keys():
        return "no cgroup v1 memory and pids hierarchies"
    parents = [_directory(mounts[c], paths[c]) for c in ("memory", "pids")]
    problem = _probe(parents, [(0, "memory.limit_in_bytes", str(64 << 20)), (1, "pids.max", "8")])
    if problem:
        return f"cgroup v1: {problem}"
    return CallBound("cgroup1", tuple(map(str, parents)))


def _v2(mounts: dict, paths: dict) -> CallBound | str:
    if "" not in mounts or "" not in paths:
        return "no cgroup v2 hierarchy"
    own = _directory(mounts[""], paths[""])
    if not {"memory", "pids"} <= set(_read(own / "cgroup.controllers").split()):
        return f"cgroup v2: {own} offers no memory and pids controllers"
    if not {"memory", "pids"} <= set(_read(own / "cgroup.subtree_control").split()):
        problem = _delegate(own)
        if problem:
            return f"cgroup v2: {problem}"
    problem = _probe([own], [(0, "memory.max", str(64 << 20)), (0, "pids.max", "8")])
    if problem:
        return f"cgroup v2: {problem}"
    return CallBound("cgroup2", (str(own),))


def _delegate(own: Path) -> str:
    """Enable memory and pids for `own`'s children: move this process into a leaf child first
    (a cgroup with controllers for its children holds no process); only when it is alone."""
    procs = _read(own / "cgroup.procs").split()
    if procs != [str(os.getpid())]:
        return f"{own} holds other processes, so it cannot enable controllers for children"
    try:
        (own / _LEAF).mkdir(exist_ok=True)
        (own / _LEAF / "cgroup.procs").write_text(str(os.getpid()))
        (own / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as e:
        return f"{e.strerror or e} at {e.filename or own}"
    return ""


@functools.lru_cache(maxsize=1)
def per_call_bound() -> CallBound:
    """The bound of this host (module docstring), decided once per process."""
    if os.environ.get(OFF_ENV, "").lower() in ("off", "0", "false", "no"):
        return CallBound("rlimits", why=f"{OFF_ENV}={os.environ[OFF_ENV]}")
    mounts = _mounts(_read(Path("/proc/self/mountinfo")))
    paths = _own_paths(_read(Path("/proc/self/cgroup")))
    # v1 controllers, where they are mounted, are not available to the v2 hierarchy (hybrid)
    found = _v1(mounts, paths) if "memory" in mounts else _v2(mounts, paths)
    if isinstance(found, str):
        return CallBound("rlimits", why=found)
    for parent in found.parents:
        _sweep(Path(parent))
    return found


class CallGroup:
    """The cgroup(s) of one call: made with their limits, the call's init attached, then read
    and removed (`close`)."""

    def __init__(self, bound: CallBound, memory_mb: int, max_tasks: int) -> None:
        self.bound = bound
        name = f"{PREFIX}-{os.getpid()}-{next(_names)}"
        self.dirs = [Path(p) / name for p in bound.parents]
        limit, files = str(memory_mb << 20), []
        if bound.kind == "cgroup2":
            files = [(0, "memory.max", limit), (0, "memory.swap.max", "0")]
            files.append((0, "pids.max", str(max_tasks)))
        else:
            files = [(0, "memory.limit_in_bytes", limit)]
            if (Path(bound.parents[0]) / "memory.memsw.limit_in_bytes").exists():
                files.append((0, "memory.memsw.limit_in_bytes", limit))  # no swapping past it
            files.append((1, "pids.max", str(max_tasks)))
        made = []
        try:
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            for index, file, value in files:
                (self.dirs[index] / file).write_text(value)
        except OSError:
            for d in made:
                _remove(d)
            raise

    def attach(self, pid: int) -> None:
        """Move `pid` (the call's init, not yet running any code) into the call's cgroup(s)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed at its memory limit."""
        name = "memory.events" if self.bound.kind == "cgroup2" else "memory.oom_control"
        for line in _read(self.dirs[0] / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def close(self) -> None:
        for d in self.dirs:
            _remove(d)


def _remove(d: Path) -> None:
    """rmdir a per-call cgroup: the kernel may take a few milliseconds to empty it after its
    last process is reaped. One it cannot remove in 2 s is left to the sweep of a later start."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.0005)
