"""Starting one sandboxed Python process under bubblewrap (see envs/sandbox.py for the guarantees).

`launch(config, limits)` starts `bwrap ... python -I -S -c <_sandbox_child.py> ...` with:

- new user, PID, mount, network, IPC, UTS (and, where the kernel has them, cgroup) namespaces;
- a root that is an empty, read-only tmpfs holding only the interpreter: its binary, the shared
  libraries it and its extension modules link (found with `ldd`), and its standard library,
  read-only, with any site-packages inside it covered by an empty directory; a private /proc of
  the new PID namespace; a minimal /dev; and `/scratch`, a tmpfs of `disk_mb`, the only writable
  place;
- the seccomp filter of envs/_seccomp.py, --die-with-parent and --new-session;
- the sandbox user, uid/gid 65534, with no capabilities. A root caller maps uid and gid 0 and
  65534 of the new user namespace to themselves (bwrap waits on --userns-block-fd for that): bwrap
  sets up the mounts as root of the namespace, and the child drops to 65534 before reading any
  untrusted input, so the code runs as the host's uid 65534, never as root, and RLIMIT_NPROC
  binds it (the kernel exempts uid 0). A non-root caller cannot map other host uids (that needs
  newuidmap): the code is uid 65534 inside the namespace and the caller's uid on the host.

The caller learns the host pid of the namespace's init from --info-fd and holds a pidfd to it:
SIGKILL to that pid ends every process in the namespace, and the bwrap launcher exits only after
they are all gone.
"""

from __future__ import annotations

import functools
import glob
import json
import marshal
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollflash.envs._seccomp import seccomp_filter, supported_machine
from rollflash.errors import RollflashError

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
SCRATCH = "/scratch"
MARKER = "rollflash-sandbox"  # argv[1] of every sandboxed process, so tests can find them
_CHILD = Path(__file__).with_name("_sandbox_child.py")
# extension modules for terminals, GUIs and NIS: their libraries (X11, Tk, ncurses, Kerberos) are
# two thirds of the binds, each a mount per call, for modules no tool code needs; they fail to
# import instead
_UNNEEDED = ("_tkinter", "readline", "_curses", "nis")


class SandboxUnavailable(RollflashError, RuntimeError):
    """The isolation the sandbox needs is missing here; the message says what and how to fix it."""


@dataclass
class Launched:
    proc: subprocess.Popen  # the bwrap launcher; stdin, stdout and stderr are pipes
    init: int | None  # pidfd of the sandbox's PID-namespace init (None if bwrap failed early)
    state_r: int  # read end of the pipe the child reports its start and its scratch files on


@dataclass(frozen=True)
class Runtime:
    executable: str  # the real interpreter binary (not a virtualenv's link to it)
    stdlib: tuple[str, ...]  # standard-library directories, bound read-only
    hidden: tuple[str, ...]  # site-packages directories inside them, covered by empty ones
    libraries: tuple[tuple[str, str], ...]  # (host file, path in the sandbox) of shared libraries


@functools.lru_cache(maxsize=1)
def runtime() -> Runtime:
    """What the sandbox shows of this interpreter (computed once per process)."""
    exe = os.path.realpath(sys.executable)
    # the base interpreter's, never a virtualenv's (whose lib/ holds only site-packages)
    pure = os.path.realpath(os.path.dirname(os.__file__))
    shared = os.path.realpath(sysconfig.get_config_var("DESTSHARED") or pure)
    inside = shared == pure or shared.startswith(pure + os.sep) or not os.path.isdir(shared)
    stdlib = [pure] if inside else [pure, shared]
    hidden = [
        os.path.join(d, name)
        for d in stdlib
        for name in ("site-packages", "dist-packages")
        if os.path.isdir(os.path.join(d, name))
    ]
    dynload = [
        path
        for path in glob.glob(os.path.join(shared, "*.so"))
        if not os.path.basename(path).startswith(_UNNEEDED)
    ]
    return Runtime(exe, tuple(stdlib), tuple(hidden), tuple(_shared_libraries([exe, *dynload])))


def _shared_libraries(binaries: list[str]) -> list[tuple[str, str]]:
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable(
            "the python tool's sandbox needs ldd (package libc-bin) to find the interpreter's "
            "shared libraries, and it is not on PATH"
        )
    out = subprocess.run([ldd, *binaries], capture_output=True, text=True, timeout=60).stdout
    found = set()
    for line in out.splitlines():
        # "\tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x...)" or "\t/lib64/ld-linux... (0x...)"
        path = line.split("=>")[-1].strip().split(" (")[0].strip()
        if path.startswith("/") and os.path.exists(path):
            found.add((os.path.realpath(path), path))
    return sorted(found)


@functools.lru_cache(maxsize=1)
def child_source() -> str:
    return _CHILD.read_text()


def _ancestors(paths: list[str]) -> list[str]:
    """Every directory above `paths`, parents first: bwrap would create them mode 0700, which the
    sandbox user could not traverse."""
    dirs = {str(p) for path in paths for p in Path(path).parents if str(p) != "/"}
    return sorted(dirs, key=lambda d: (d.count("/"), d))


def bwrap_argv(config: dict, disk_mb: int, fds: dict[str, int]) -> list[str]:
    """The bwrap command line; `fds`: "info", "seccomp", and "userns_block" (root) or "block"."""
    rt = runtime()
    bwrap = shutil.which("bwrap") or "bwrap"
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
    argv += ["--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    argv += ["--hostname", "sandbox", "--clearenv", "--setenv", "LANG", "C.UTF-8"]
    argv += ["--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--cap-drop", "ALL"]
    argv += ["--info-fd", str(fds["info"]), "--seccomp", str(fds["seccomp"])]
    if "userns_block" in fds:  # root: the caller maps 0 and 65534; the child drops to 65534
        argv += ["--userns-block-fd", str(fds["userns_block"]), "--uid", "0", "--gid", "0"]
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # the child waits before exec until the caller holds a pidfd of the init
        argv += ["--block-fd", str(fds["block"]), "--disable-userns"]
        argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    dests = [rt.executable, *rt.stdlib, *(dest for _, dest in rt.libraries)]
    for d in _ancestors(dests):
        argv += ["--perms", "0755", "--dir", d]
    for d in rt.stdlib:
        argv += ["--ro-bind", d, d]
    argv += ["--ro-bind", rt.executable, rt.executable]
    for src, dest in rt.libraries:
        argv += ["--ro-bind", src, dest]
    for d in rt.hidden:
        argv += ["--perms", "0555", "--tmpfs", d, "--remount-ro", d]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", SCRATCH]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH]
    argv += [rt.executable, "-I", "-S", "-c", child_source(), MARKER, marshal.dumps(config).hex()]
    return argv


def launch(config: dict, disk_mb: int, attach: Callable[[int], None] | None = None) -> Launched:
    """Start the sandboxed child (config: see _sandbox_child.main); stdin, stdout and stderr are
    pipes, `state_fd` in the child is the write end of `Launched.state_r`. `attach(pid)` places
    the namespace's init in the call's cgroup while it waits for us, before any code runs; if
    that fails the init is killed and the OSError raised."""
    machine = supported_machine()
    if machine is None:
        raise SandboxUnavailable("the python tool's sandbox has no seccomp filter for this CPU")
    root = os.geteuid() == 0
    info_r, info_w = os.pipe()
    state_r, state_w = os.pipe()
    seccomp_r, seccomp_w = os.pipe()
    os.write(seccomp_w, seccomp_filter(machine))  # a few hundred bytes: fits the pipe buffer
    os.close(seccomp_w)
    block_r, block_w = os.pipe()
    fds = {"info": info_w, "seccomp": seccomp_r, "userns_block" if root else "block": block_r}
    config = {**config, "state_fd": state_w, "drop_to": SANDBOX_UID if root else None}
    passed = [*fds.values(), state_w]
    try:
        proc = subprocess.Popen(
            bwrap_argv(config, disk_mb, fds),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=passed,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
    except BaseException:
        for fd in (info_r, state_r, block_w):
            os.close(fd)
        raise
    finally:
        for fd in passed:
            os.close(fd)
    pid, init = _open_init(info_r)
    try:
        if init is not None and attach is not None:
            attach(pid)
        if root and init is not None:
            _map_users(pid)
    except BaseException:
        _abandon(proc, init, block_w, state_r)
        raise
    try:
        os.write(block_w, b"1")  # bwrap goes on (and fails cleanly if the maps are missing)
    except BrokenPipeError:
        pass  # bwrap has already exited; its stderr says why
    finally:
        os.close(block_w)
    return Launched(proc, init, state_r)


def kill_namespace(init: int | None) -> None:
    """SIGKILL the PID namespace's init (a pidfd): the kernel then kills every process inside."""
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _abandon(proc: subprocess.Popen, init: int | None, *fds: int) -> None:
    """Kill a launch that cannot go on (its init never ran any code) and reap it."""
    kill_namespace(init)
    if init is not None:
        os.close(init)
    for fd in fds:
        os.close(fd)
    proc.kill()
    proc.communicate()


def _open_init(info_r: int) -> tuple[int, int | None]:
    """The pid and a pidfd of the namespace's init, from the JSON bwrap writes on --info-fd after
    clone(); the init is still waiting for us then, so the pid cannot have been reused."""
    with os.fdopen(info_r, "rb") as f:
        info = f.read(64_000)
    try:
        pid = int(json.loads(info)["child-pid"])
        return pid, os.pidfd_open(pid)
    except (ValueError, KeyError, OSError):
        return 0, None  # bwrap failed before clone(); its stderr says why


def _map_users(pid: int) -> None:
    """uid and gid 0 and 65534 of the new user namespace are the host's 0 and 65534."""
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")
        except OSError:
            return
