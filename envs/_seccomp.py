"""The seccomp filter of the Python sandbox's processes, as classic BPF for `bwrap --seccomp FD`.

The filter is a deny-list on top of the namespaces (envs/sandbox.py): it refuses the system calls
that reach kernel state the namespaces do not isolate, or that would let the code rebuild a view
of the host:

- debugging and reading other processes: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd;
- mounts and namespaces: mount, umount2, pivot_root, chroot, the new mount API (open_tree,
  open_tree_attr, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr), unshare, setns,
  and clone with any CLONE_NEW* flag; clone3 answers ENOSYS, so that glibc falls back to clone,
  whose flags the filter can read (clone3 passes them in memory, out of a filter's reach);
- the kernel keyring (keyctl, add_key, request_key), bpf, perf_event_open, userfaultfd,
  io_uring_*, open_by_handle_at / name_to_handle_at, fanotify_init;
- machine administration: modules, kexec, reboot, swap, syslog, acct, quotactl, clocks,
  host and domain names, personality, vhangup, iopl / ioperm, uselib, lookup_dcookie.

Two parts are allow-lists instead:
- sockets: socket() and socketpair() succeed for AF_UNIX only (asyncio's self-pipe and
  socketpair() use it; the mount and network namespaces leave no unix socket of the host to
  reach); every other family (AF_INET, AF_INET6, AF_PACKET, AF_NETLINK, AF_VSOCK, ...) fails
  with EAFNOSUPPORT, whatever the namespaces would have let through (a VM's vsock, for one, is
  not in any namespace);
- system-call numbers: the tables below end at LAST_KNOWN (open_tree_attr, 467, Linux 6.15);
  every higher number answers ENOSYS, so a call added to a later kernel is refused until it is
  reviewed here.

Refused calls fail with EPERM, so the code sees an ordinary OSError. A process of another
architecture than the interpreter's (e.g. the i386 entry point on x86_64) is killed, and on x86_64
the x32 system-call range is refused. Everything else is allowed: the process runs as an
unprivileged user in its own namespaces, so the remaining calls reach only what those leave.

Why not libseccomp: its Python binding is a Debian package built for the system interpreter, not
installable into a virtualenv, and this filter is a fixed list of a few dozen comparisons. The
numbers below come from the kernel's tables (x86_64: arch/x86/entry/syscalls/syscall_64.tbl;
aarch64: include/uapi/asm-generic/unistd.h), and tests/security/ checks they take effect.
"""

from __future__ import annotations

import errno
import platform
import struct

# syscall name -> (x86_64 number, aarch64 number); None where the architecture has no such call
_DENIED: dict[str, tuple[int | None, int | None]] = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "open_tree_attr": (467, 467),
    "unshare": (272, 97),
    "setns": (308, 268),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "fanotify_init": (300, 262),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "syslog": (103, 116),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "personality": (135, 92),
    "vhangup": (153, 58),
    "lookup_dcookie": (212, 18),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435  # the same number on both
_SOCKET = {"x86_64": (41, 53), "aarch64": (198, 199)}  # socket, socketpair
AF_UNIX = 1  # the one socket family allowed
LAST_KNOWN = 467  # open_tree_attr: the highest number in the tables (the same on both machines)
# AUDIT_ARCH_* (linux/audit.h): what seccomp_data.arch holds for a native system call
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64 system calls with this bit set use the x32 ABI
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (linux/sched.h)
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = 32-bit word at offset k of seccomp_data
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45  # BPF_JMP | BPF_{JEQ,JGE,JSET} | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6];}: the low word of
# args[0] sits at offset 16 on the little-endian machines supported here
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


def supported_machine() -> str | None:
    """The machine name if the filter supports it (x86_64, aarch64), else None."""
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return machine if machine in _AUDIT_ARCH else None


def denied_syscalls(machine: str) -> dict[str, int]:
    """Name -> number of every call the filter refuses with EPERM on `machine`."""
    column = 0 if machine == "x86_64" else 1
    return {name: nr for name, nrs in _DENIED.items() if (nr := nrs[column]) is not None}


def seccomp_filter(machine: str) -> bytes:
    """The filter program for `machine` ("x86_64" or "aarch64"), as the bytes bwrap reads: an
    array of `struct sock_filter {u16 code; u8 jt; u8 jf; u32 k;}` in native byte order."""
    if machine not in _AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for machine {machine!r} (x86_64, aarch64)")
    # (code, jump-if-true, jump-if-false, k); a jump is a label name or 0 (the next instruction)
    socket, socketpair = _SOCKET[machine]
    program: list[tuple[int, str | int, str | int, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ, 0, "kill", _AUDIT_ARCH[machine]),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        program.append((_JGE, "deny", 0, _X32_BIT))
    program += [
        (_JGE, "enosys", 0, LAST_KNOWN + 1),  # newer than the tables: unknown, refused
        (_JEQ, "enosys", 0, _CLONE3),
        (_JEQ, 0, "sockets", _CLONE[machine]),
        (_LD_W_ABS, 0, 0, _ARG0_LOW),  # clone's flags
        (_JSET, "deny", "allow", CLONE_NEW_FLAGS),
    ]
    labels = {"sockets": len(program)}
    program += [
        (_JEQ, "family", 0, socket),
        (_JEQ, 0, "list", socketpair),
    ]
    labels["family"] = len(program)
    program += [
        (_LD_W_ABS, 0, 0, _ARG0_LOW),  # the domain: an int, so the kernel reads the low word only
        (_JEQ, "allow", "no_family", AF_UNIX),
    ]
    labels["list"] = len(program)
    program += [(_JEQ, "deny", 0, nr) for nr in sorted(denied_syscalls(machine).values())]
    for name, value in (
        ("allow", _ALLOW),
        ("deny", _ERRNO | errno.EPERM),
        ("enosys", _ERRNO | errno.ENOSYS),
        ("no_family", _ERRNO | errno.EAFNOSUPPORT),
        ("kill", _KILL_PROCESS),
    ):
        labels[name] = len(program)
        program.append((_RET, 0, 0, value))

    def offset(at: int, target: str | int) -> int:
        if target == 0:
            return 0
        jump = labels[str(target)] - at - 1  # relative to the next instruction, forward only
        assert 0 <= jump < 256, (target, jump)
        return jump

    return b"".join(
        struct.pack("=HBBI", code, offset(i, jt), offset(i, jf), k)
        for i, (code, jt, jf, k) in enumerate(program)
    )
