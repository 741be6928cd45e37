"""The sandbox's child process (run as `python -I -S _sandbox_child.py CONFIG_JSON`); see sandbox.py.

Order matters: kernel limits first, then the network namespace and the drop to an unprivileged
user (both need root, if we have it), then the audit hook, and only then the untrusted code. This
file must not import anything outside the standard library, and nothing that starts threads.
"""

import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NOBODY = 65534
PR_SET_PDEATHSIG = 1
# imported before the privilege drop, so that code can use them even where the interpreter's own
# files are not readable by the unprivileged user (e.g. a Python installed under /root)
PRELOAD = (
    "math",
    "cmath",
    "json",
    "re",
    "collections",
    "itertools",
    "functools",
    "random",
    "statistics",
    "string",
    "decimal",
    "fractions",
    "datetime",
    "heapq",
    "bisect",
    "operator",
    "socket",
)  # socket: so that a connect attempt meets the hook and the empty namespace

# audit events whose first argument is a path: reads may look at the scratch directory and the
# interpreter's library directories, everything else at the scratch directory only
_READ_EVENTS = {"open", "os.listdir", "os.scandir"}
_PATH_EVENTS = _READ_EVENTS | {
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.utime",
    "os.chdir",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "os.chflags",
    "os.setxattr",
    "os.removexattr",
}
# events that would leave the sandbox: new processes, sockets, foreign code, signals, hook removal
_BLOCKED = {
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.startfile",
    "subprocess.Popen",
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "ctypes.call_function",
    "os.kill",
    "os.killpg",
    "sys.setprofile",
    "sys.settrace",
    "os.add_dll_directory",
    "mmap.__new__",
    "os.putenv",
    "pty.spawn",
    "resource.setrlimit",
    "resource.prlimit",
    "sys._current_frames",
}

# modules that reach syscalls without raising an audit event (e.g. _posixsubprocess.fork_exec)
_BLOCKED_MODULES = {
    "ctypes",
    "_ctypes",
    "_posixsubprocess",
    "_xxsubinterpreters",
    "_testcapi",
    "_testinternalcapi",
}


def _set_limits(cfg: dict) -> None:
    mb = 1024 * 1024
    for name, value in (
        ("RLIMIT_CPU", cfg["cpu_s"]),
        ("RLIMIT_AS", cfg["memory_mb"] * mb),
        ("RLIMIT_FSIZE", cfg["file_mb"] * mb),
        ("RLIMIT_NPROC", cfg["nproc"]),
        ("RLIMIT_NOFILE", 64),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def _isolate_network(libc) -> bool:
    """A fresh, empty network namespace (only a down loopback) via unshare(2)."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    return libc.unshare(flags) == 0


def _die_with_parent(libc, parent: int) -> None:
    """SIGKILL this process when the parent dies (a generator killed with -9 leaves no sandbox
    behind). After the privilege drop, which clears the setting."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _drop_privileges(scratch: str) -> None:
    if os.geteuid() != 0:
        return
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)  # RLIMIT_NPROC binds only a non-root user; root-owned files become read-only


def _install_hook(scratch: str, readable: list[str]) -> None:
    scratch = os.path.realpath(scratch)

    def inside(path: str, roots: list[str]) -> bool:
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r + os.sep) for r in roots)

    def hook(event: str, args: tuple) -> None:
        if event in _BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event in _PATH_EVENTS and args:
            path = args[0]
            if isinstance(path, int):  # an already-open descriptor (os.open with dir_fd etc.)
                return
            path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
            if path is None:
                return
            write = event not in _READ_EVENTS or event == "open" and _opens_for_write(args)
            roots = [scratch] if write else [scratch] + readable
            if not inside(path, roots):
                raise PermissionError(f"sandbox: access to {path!r} outside the scratch directory")

    sys.addaudithook(hook)


def _opens_for_write(args: tuple) -> bool:
    mode, flags = (args + (None, None))[1:3]
    if isinstance(mode, str) and any(ch in mode for ch in "wax+"):
        return True
    return isinstance(flags, int) and bool(
        flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _set_limits(cfg)
    parent = os.getppid()
    import ctypes  # for unshare and prctl only; removed again before the user's code runs

    libc = ctypes.CDLL(None, use_errno=True)
    if cfg["isolate_network"]:
        _isolate_network(libc)  # on failure the audit hook still refuses sockets (see sandbox.py)
    for name in PRELOAD:
        __import__(name)
    _drop_privileges(cfg["scratch"])
    _die_with_parent(libc, parent)
    del libc, ctypes
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # so that the code's `import ctypes` reaches the audit hook
    os.chdir(cfg["scratch"])
    # modules the user's code may import are read from the interpreter's own directories only
    readable = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
    sys.path[:] = [p for p in sys.path if p and "site-packages" not in p]
    os.environ.clear()
    source = open("main.py").read()
    code = compile(source, "main.py", "exec")
    if cfg.get("audit_hook", True):  # False only in tests of the kernel-level layers
        _install_hook(cfg["scratch"], readable)
    del sys.argv[1:]
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
