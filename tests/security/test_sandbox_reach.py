"""Attacks on what the python tool's processes can reach, each written as the hostile code itself
and run through the real tool environment with the audit hook switched off first: processes that
try to outlive the call, the user they run as, a real Redis server's unix socket and TCP port,
the run directory, the network, and the system calls the seccomp filter refuses."""

import dataclasses
import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis
from sandbox_harness import HOOK_OFF, RAW_SYSCALL, SKIP_SANDBOX, host_processes_with

from rollflash.envs._seccomp import denied_syscalls, supported_machine

pytestmark = SKIP_SANDBOX


def _sleeper(token: str) -> str:
    """Code for a process that sleeps a minute with `token` in its command line (so the host
    can find it)."""
    return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])"


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_no_process_outlives_the_call(python_tool, run_hostile, ending):
    """A forked child, a double-forked grandchild and a setsid() one each exec a sleeper (the code
    sees all three running); the call ends (normally, or killed at the wall-clock limit) and
    none of them is left."""
    token = f"rollflash-escape-{uuid.uuid4().hex}"
    code = f"""
for how in ("fork", "double", "setsid"):
    if os.fork() == 0:
        if how == "setsid":
            os.setsid()
        if how == "double" and os.fork() != 0:
            os._exit(0)
        {_sleeper(token)}
def sleepers():
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found += {token!r}.encode() in open(f"/proc/{{pid}}/cmdline", "rb").read()
        except OSError:
            pass
    return found
while sleepers() < 3:  # bounded by the call's wall-clock limit
    time.sleep(0.05)
print(json.dumps({{"started": sleepers()}}))
{"time.sleep(60)" if ending == "timeout" else ""}
"""
    if ending == "exit":  # a limit only a hang reaches, however slowly the sleepers start
        python_tool.limits = dataclasses.replace(python_tool.limits, wall_s=300.0)
        assert run_hostile("import time\n" + code) == {"started": 3}
    else:
        python_tool.limits = dataclasses.replace(python_tool.limits, wall_s=3.0)
        obs = python_tool.step("python: " + HOOK_OFF + "import time\n" + code).observation
        assert obs == "error: timeout after 3s wall clock\n"
    assert host_processes_with(token) == []


def test_runs_as_the_sandbox_user_with_no_capabilities(run_hostile):
    out = run_hostile("""
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({
    "uid": status["Uid"].split(), "gid": status["Gid"].split(), "groups": status["Groups"].split(),
    "cap_eff": status["CapEff"].strip(), "cap_prm": status["CapPrm"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
    "uid_map": open("/proc/self/uid_map").read().split(), "procs": sorted(
        int(p) for p in os.listdir("/proc") if p.isdigit()),
}))
""")
    assert out["uid"] == ["65534"] * 4 and out["gid"] == ["65534"] * 4 and out["groups"] == []
    assert out["cap_eff"] == out["cap_prm"] == "0" * 16
    assert out["no_new_privs"] == "1" and out["seccomp"] == "2"  # 2: a filter is loaded
    assert out["procs"] == [1, 2]  # bwrap's reaper and the code: no other process is visible
    if os.geteuid() == 0:  # the generator's uid is not reused: 65534 inside is 65534 on the host
        assert out["uid_map"] == ["0", "0", "1", "65534", "65534", "1"]
        assert os.geteuid() != 65534


@pytest.fixture
def real_redis(tmp_path):
    """A redis-server on a unix socket (in a 0700 directory, as the embedded one) and a TCP port."""
    sock_dir = tmp_path / "redis"
    sock_dir.mkdir(mode=0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = sock_dir / "redis.sock"
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1"]
        + [
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(unix_socket_path=str(sock))
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.ping()  # reachable from the host, so the test means something
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield sock, port
    finally:
        proc.kill()
        proc.wait()


def test_redis_socket_port_and_run_dir_are_out_of_reach(run_hostile, real_redis, tmp_path):
    sock, port = real_redis
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("redis:\n  url: redis://:hunter2@127.0.0.1/0\n")
    out = run_hostile(f"""
import socket
out = {{}}
def unix():
    with socket.socket(socket.AF_UNIX) as s:
        s.connect({str(sock)!r})
def tcp():
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
        s.sendall(b"PING\\r\\n")
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = f"{{type(e).__name__}} {{e.errno}}"
attempt("unix_socket", unix)
attempt("tcp_port", tcp)
attempt("run_dir", lambda: open({str(run_dir / "config.yaml")!r}).read())
attempt("run_dir_list", lambda: os.listdir({str(run_dir)!r}))
print(json.dumps(out))
""")
    # the socket's path and the run directory do not exist in the sandbox's mount namespace
    # (2: ENOENT); no AF_INET socket can be made (97: EAFNOSUPPORT)
    assert out == {
        "unix_socket": "FileNotFoundError 2",
        "tcp_port": "OSError 97",
        "run_dir": "FileNotFoundError 2",
        "run_dir_list": "FileNotFoundError 2",
    }


def test_no_network(run_hostile):
    """Only AF_UNIX sockets can be made (for asyncio's self-pipe and socketpair()); every other
    family fails at socket(), with the family in the low word of the argument or with garbage
    in the high word, which the kernel ignores. AF_VSOCK matters on a VM: the host's vsock port
    space is in no namespace."""
    machine = supported_machine()
    socket_nr, socketpair_nr = {"x86_64": (41, 53), "aarch64": (198, 199)}[machine]
    out = run_hostile(
        RAW_SYSCALL
        + f"""
import socket
out = {{}}
families = {{"inet": socket.AF_INET, "inet6": socket.AF_INET6, "packet": socket.AF_PACKET,
            "netlink": socket.AF_NETLINK, "vsock": socket.AF_VSOCK, "unix": socket.AF_UNIX}}
for name, family in families.items():
    kind = socket.SOCK_RAW if family in (socket.AF_PACKET, socket.AF_NETLINK) else socket.SOCK_STREAM
    try:
        socket.socket(family, kind).close()
        out[name] = "ok"
    except OSError as e:
        out[name] = e.errno
a, b = socket.socketpair()
a.sendall(b"ping")
out["socketpair_unix"] = b.recv(4).decode()
out["socketpair_inet"] = call({socketpair_nr}, socket.AF_INET, socket.SOCK_STREAM, 0,
                             ctypes.addressof(ctypes.create_string_buffer(8)))
out["vsock_high_word"] = call({socket_nr}, (1 << 32) | socket.AF_VSOCK, socket.SOCK_STREAM, 0)
for name, addr in (("public_ip", ("1.1.1.1", 80)), ("dns", ("8.8.8.8", 53))):
    try:
        socket.create_connection(addr, timeout=2)
        out[name] = "ok"
    except OSError as e:
        out[name] = e.errno
try:
    socket.getaddrinfo("example.com", 80)
    out["resolve"] = "ok"
except OSError as e:
    out["resolve"] = type(e).__name__
print(json.dumps(out))
"""
    )
    refused = 97  # EAFNOSUPPORT
    assert out == {
        **dict.fromkeys(["inet", "inet6", "packet", "netlink", "vsock"], refused),
        "unix": "ok",
        "socketpair_unix": "ping",
        "socketpair_inet": refused,
        "vsock_high_word": refused,
        "public_ip": refused,
        "dns": refused,
        "resolve": "gaierror",
    }


def test_the_code_holds_only_the_documented_descriptors(run_hostile):
    """0 stdin, 1 stdout, 2 stderr and 3 the state pipe (envs/_sandbox_child.py), all pipes:
    none of the descriptors bwrap was handed (the block and info pipes, the filter) is left."""
    out = run_hostile("""
open_fds = {}
for fd in range(1 << 16):
    try:
        os.fstat(fd)
    except OSError:
        continue
    open_fds[fd] = os.readlink(f"/proc/self/fd/{fd}").split(":")[0]
print(json.dumps(open_fds))
""")
    assert out == {"0": "pipe", "1": "pipe", "2": "pipe", "3": "pipe"}


def test_seccomp_refuses_ptrace_mount_keyctl_and_namespaces(run_hostile):
    """Calls an unprivileged process may normally make (ptrace(TRACEME), a new user namespace,
    looking up its session keyring, querying its personality) fail with EPERM, as does every
    other call of the deny-list; numbers past the filter's tables (468 and 469 exist since
    Linux 6.17) answer ENOSYS; an allowed call (getppid) still works."""
    machine = supported_machine()
    numbers = denied_syscalls(machine)
    clone_newuser = 0x10000000 | 17  # CLONE_NEWUSER | SIGCHLD
    out = run_hostile(
        RAW_SYSCALL
        + f"""
n = {numbers!r}
out = {{
    "ptrace_traceme": call(n["ptrace"], 0, 0, 0, 0),
    "unshare_user": call(n["unshare"], 0x10000000),
    "keyctl_session": call(n["keyctl"], 0, -3, 0),  # KEYCTL_GET_KEYRING_ID, session
    "personality_query": call(n["personality"], 0xFFFFFFFF),
    "mount": call(n["mount"], 0, 0, 0, 0, 0),
    "clone_newuser": call({ {"x86_64": 56, "aarch64": 220}[machine] }, {clone_newuser}, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "open_tree_attr": call(467, -100, 0, 0, 0, 0),
    "newer_than_the_tables": sorted({{call(nr) for nr in (468, 469, 470, 511, 1000)}}, key=str),
    "getppid": call(110 if {machine!r} == "x86_64" else 173),
}}
out["deny_list"] = sorted({{call(nr, 0, 0, 0, 0, 0, 0) for name, nr in n.items()
                            if name not in ("reboot", "vhangup")}}, key=str)
print(json.dumps(out))
"""
    )
    assert out == {
        "ptrace_traceme": 1,  # EPERM
        "unshare_user": 1,
        "keyctl_session": 1,
        "personality_query": 1,
        "mount": 1,
        "clone_newuser": 1,
        "clone3": 38,  # ENOSYS, so that glibc falls back to clone, whose flags the filter reads
        "open_tree_attr": 1,
        "newer_than_the_tables": [38],  # unknown numbers: ENOSYS, whatever a newer kernel has
        "getppid": "ok",
        "deny_list": [1],
    }
