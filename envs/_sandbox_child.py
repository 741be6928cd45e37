"""The sandboxed process: run by bwrap as `python -I -S -c <this file> rollflash-sandbox CONFIG`
(CONFIG: a dict, marshal-encoded, in hex; marshal and the other imports here are built into the
interpreter or cheap, so that a call costs little more than the interpreter's start).

It runs inside the namespaces and under the seccomp filter that envs/_bwrap.py set up. Order:
0. keep only the descriptors the code may hold: 0, 1, 2 and the state pipe, moved to 3 (bwrap
   leaves the ones it was handed open, e.g. the read end of --userns-block-fd);
1. drop to the sandbox user (uid/gid 65534, no capabilities) if bwrap left us root of the user
   namespace, and stop unless that worked;
2. kernel limits (resource.setrlimit, which the code cannot raise again): CPU seconds, address
   space, file size, processes, open files, no core dumps;
3. tell the parent we started (one byte on the state pipe), then read from stdin the scratch
   files of the previous call and the code, each after its 8-byte length; the rest of stdin is
   the code's own input;
4. restore the files into /scratch, install the audit hook (a second layer, see below), run the
   code; whatever happens, pack /scratch back onto the state pipe for the next call (an 8-byte
   length, then the files as a marshal-encoded list).

The audit hook (PEP 578) refuses paths outside the scratch directory and the standard library,
process creation, sockets and ctypes. It is not a boundary (Python code can switch it off); the
namespaces and the filter are. This file imports nothing outside the standard library.
"""

import io
import marshal
import os
import resource
import sys

SCRATCH = "/scratch"
CAP_LINE = "CapEff:"
STATE_FD = 3  # the state pipe: with 0, 1 and 2 the only descriptors the code's process holds

# audit events whose first argument is a path: reads may look at the scratch directory and the
# standard library, everything else at the scratch directory only
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
# events that would leave the sandbox: new processes, sockets, foreign code, signals, limits
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
    "mmap.__new__",
    "os.putenv",
    "pty.spawn",
    "resource.setrlimit",
    "resource.prlimit",
    "sys._current_frames",
}
# modules that reach system calls without an audit event (e.g. _posixsubprocess.fork_exec)
_BLOCKED_MODULES = {
    "ctypes",
    "_ctypes",
    "_posixsubprocess",
    "_xxsubinterpreters",
    "_testcapi",
    "_testinternalcapi",
}


def _keep_only_own_fds(state_fd: int) -> None:
    if state_fd != STATE_FD:
        os.dup2(state_fd, STATE_FD, inheritable=False)
    os.closerange(STATE_FD + 1, 1 << 20)


def _become_sandbox_user(uid: int | None) -> None:
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from uid 0 of the namespace: clears every capability
    with open("/proc/self/status") as f:
        caps = [ln.split()[1] for ln in f if ln.startswith(CAP_LINE)]
    if os.getuid() == 0 or os.getgid() == 0 or caps != ["0" * 16]:
        sys.stderr.write("sandbox: could not drop to an unprivileged user\n")
        os._exit(70)


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


def _read_exact(n: int) -> bytes:
    """`n` bytes of stdin (fewer at its end), read from the descriptor: whatever follows them
    is the code's own input, and nothing may be read ahead of it into a buffer."""
    parts, left = [], n
    while left:
        chunk = os.read(0, min(left, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_input() -> tuple[bytes, str]:
    state = _read_exact(int.from_bytes(_read_exact(8), "little"))
    source = _read_exact(int.from_bytes(_read_exact(8), "little"))
    return state, source.decode("utf-8", errors="replace")


def _restore(state: bytes) -> None:
    """Recreate the previous call's files from `state`, a marshal-encoded list of
    ("d", path) | ("f", path, mode, bytes) | ("l", path, target). The list was written inside the
    sandbox (by `_save`, or by the code itself): entries that do not fit are skipped, and only
    /scratch is writable here anyway."""
    try:
        entries = marshal.loads(state) if state else []
    except Exception:
        return
    for entry in entries if isinstance(entries, list) else []:
        try:
            kind, path = entry[0], os.path.normpath(entry[1])
            if path.startswith(("/", "..")):
                continue
            full = os.path.join(SCRATCH, path)
            if kind == "d":
                os.mkdir(full)
            elif kind == "l":
                os.symlink(entry[2], full)
            elif kind == "f":
                fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, entry[2])
                with open(fd, "wb") as f:
                    f.write(entry[3])
        except Exception:
            continue


def _save(fd: int) -> None:
    """Write /scratch to `fd` as an 8-byte length and the list `_restore` reads."""
    entries: list[tuple] = []

    def walk(rel: str) -> None:
        for e in sorted(os.scandir(os.path.join(SCRATCH, rel)), key=lambda e: e.name):
            path = os.path.join(rel, e.name)
            if e.is_symlink():
                entries.append(("l", path, os.readlink(e.path)))
            elif e.is_dir():
                entries.append(("d", path))
                walk(path)
            elif e.is_file():
                with open(e.path, "rb") as f:
                    entries.append(("f", path, e.stat().st_mode & 0o777, f.read()))

    walk("")
    data = marshal.dumps(entries)
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view) :]


def _install_hook(readable: list[str]) -> None:
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
            if not isinstance(path, (str, bytes, os.PathLike)):
                return  # an open descriptor: the kernel layers decide
            path = os.fsdecode(path)
            write = event not in _READ_EVENTS or event == "open" and _opens_for_write(args)
            roots = [SCRATCH] if write else [SCRATCH] + readable
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
    cfg = marshal.loads(bytes.fromhex(sys.argv[2]))
    _keep_only_own_fds(cfg["state_fd"])
    _become_sandbox_user(cfg["drop_to"])
    _set_limits(cfg)
    state_fd = STATE_FD
    os.write(state_fd, b"S")  # started: anything after this is the code's doing
    state, source = _read_input()
    os.chdir(SCRATCH)
    _restore(state)
    for stream in (sys.stdout, sys.stderr):
        assert isinstance(stream, io.TextIOWrapper)  # a fresh interpreter's, on fds 1 and 2
        stream.reconfigure(encoding="utf-8", errors="backslashreplace")
    main_pid = os.getpid()
    try:
        code = compile(source, "main.py", "exec")
        if cfg["audit_hook"]:  # False only in tests of the kernel-level layers
            _install_hook(cfg["readable"])
        del sys.argv[1:]
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    finally:
        try:
            sys.stdout.flush()
            if os.getpid() == main_pid:  # not in a process the code forked
                _save(state_fd)
        except BaseException:
            pass  # the files of this call are lost; the parent keeps the previous ones


if __name__ == "__main__":
    main()
