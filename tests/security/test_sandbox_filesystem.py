"""Attacks on the python tool's filesystem boundary, each written as the hostile code itself and run
through the real tool environment (envs/tools.py -> envs/sandbox.py under bubblewrap): switching
off the audit hook, then reading host files; path escapes; links planted in the scratch directory;
filling the disk. The host files each attack aims at must stay unread and untouched."""

import json

import pytest
from sandbox_harness import ROOT, SKIP_SANDBOX

pytestmark = SKIP_SANDBOX

SECRET = "s3cret-4711-do-not-leak"

# Three independent ways to disarm a Python audit hook from inside: make its path check see every
# path as inside (monkeypatching os.path.realpath), empty the sets it checks against, or replace
# its code object.
TAMPERING = {
    "realpath": "import os.path\nos.path.realpath = lambda p: '/scratch'\n",
    "globals": (
        "import gc\nfor f in gc.get_objects():\n"
        "    if type(f) is type(lambda: 0) and f.__name__ == 'hook':\n"
        "        f.__globals__['_BLOCKED'].clear(); f.__globals__['_BLOCKED_MODULES'].clear()\n"
        "        f.__globals__['_PATH_EVENTS'].clear()\n"
    ),
    "code": (
        "import gc\ndef _shape():\n    inside = readable = None\n"
        "    def hook(e, a):\n        return (inside, readable) and None\n    return hook\n"
        "for f in gc.get_objects():\n"
        "    if type(f) is type(_shape) and f.__name__ == 'hook' and f.__code__.co_freevars:\n"
        "        f.__code__ = _shape().__code__\n"
    ),
}


def _attempts(paths: dict[str, str]) -> str:
    """Code that tries to read each path and prints {name: exception name or the text read}."""
    return (
        "import json\nout = {}\n"
        f"for name, path in {paths!r}.items():\n"
        "    try:\n        out[name] = 'READ ' + open(path).read()[:100]\n"
        "    except Exception as e:\n        out[name] = type(e).__name__\n"
        "import os\nout['root'] = sorted(os.listdir('/'))\n"
        "print(json.dumps(out))"
    )


@pytest.fixture
def host_secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text(SECRET)
    path.chmod(0o644)  # world-readable: only the mount namespace keeps it out of reach
    return path


@pytest.mark.parametrize("technique", sorted(TAMPERING))
def test_hook_tampering_then_reading_host_files(python_tool, host_secret, technique):
    targets = {
        "shadow": "/etc/shadow",
        "passwd": "/etc/passwd",
        "project": str(ROOT / "setup.py"),
        "secret": str(host_secret),
    }
    obs = python_tool.step("python: " + TAMPERING[technique] + _attempts(targets)).observation
    assert obs.startswith("output: "), obs
    out = json.loads(obs[len("output: ") :])
    # the hook refuses listing "/": getting the list proves it was off; the list is the sandbox's
    assert "scratch" in out.pop("root") and SECRET not in obs
    assert out == {name: "FileNotFoundError" for name in targets}


def test_path_escapes(run_hostile, host_secret):
    """Relative, dir-fd relative, /proc/self/root, /proc/1/root, and a symlink in scratch."""
    target = str(host_secret)
    code = f"""
target = {target!r}
out = {{}}
def attempt(name, fn):
    try:
        out[name] = "READ " + fn()[:100]
    except Exception as e:
        out[name] = type(e).__name__
attempt("relative", lambda: open("../" * 20 + target.lstrip("/")).read())
def via_dir_fd():
    fd = os.open("/", os.O_RDONLY)
    return os.read(os.open(target.lstrip("/"), os.O_RDONLY, dir_fd=fd), 100).decode()
attempt("dir_fd", via_dir_fd)
attempt("proc_self_root", lambda: open("/proc/self/root" + target).read())
attempt("proc_1_root", lambda: open("/proc/1/root" + target).read())
os.symlink(target, "link")
attempt("symlink", lambda: open("link").read())
os.symlink("/", "rootlink")
attempt("symlink_dir", lambda: open("rootlink" + target).read())
attempt("proc_1_cwd", lambda: str(os.listdir("/proc/1/cwd")))
print(json.dumps(out))
"""
    out = run_hostile(code)
    assert SECRET not in json.dumps(out)
    expected = dict.fromkeys(
        ["relative", "dir_fd", "proc_self_root", "symlink", "symlink_dir"], "FileNotFoundError"
    )
    # pid 1 is bwrap's reaper, owned by uid 0 of the namespace: its root and cwd are not ours
    expected.update(proc_1_root="PermissionError", proc_1_cwd="PermissionError")
    assert out == expected


def test_planted_links_never_reach_the_host(python_tool, run_hostile, tmp_path):
    """Links planted under every name a sandbox might write through (main.py, outputs), and
    writes through them in this and the next call: the caller never writes to a path the sandbox
    can touch, and inside the sandbox the host's paths do not exist."""
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    planted = tmp_path / "planted"
    code = f"""
for name in ("main.py", "out", "err", "state", "code.py"):
    os.symlink({str(planted)!r}, name)
os.symlink({str(victim)!r}, "victim")
try:
    open("victim", "w").write("pwned")
    wrote = "yes"
except OSError as e:
    wrote = type(e).__name__
try:
    os.link("/proc/self/exe", "hard")
    hard = "yes"
except OSError as e:
    hard = type(e).__name__
print(json.dumps({{"wrote": wrote, "hard": hard, "files": sorted(os.listdir("."))}}))
"""
    out = run_hostile(code)
    assert out["wrote"] == "FileNotFoundError" and out["hard"] in ("PermissionError", "OSError")
    assert out["files"] == ["code.py", "err", "main.py", "out", "state", "victim"]
    # the next call writes through whatever the restored scratch directory holds under those names
    again = run_hostile(
        "out = {}\nfor name in ('main.py', 'out', 'err', 'state', 'code.py', 'victim'):\n"
        "    try:\n        open(name, 'w').write('pwned')\n        out[name] = 'wrote'\n"
        "    except OSError as e:\n        out[name] = type(e).__name__\n"
        "print(json.dumps(out))"
    )
    assert set(again.values()) <= {"wrote", "FileNotFoundError"}
    python_tool.step("python: print(1)")
    python_tool.close()
    assert victim.read_text() == "original" and not planted.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_disk_filling_is_bounded(run_hostile, python_tool):
    """/scratch holds at most 16 MB (tmpfs size); one file at most 1 MB (RLIMIT_FSIZE)."""
    code = """
out = {}
try:
    with open("big", "wb") as f:
        f.write(b"x" * (2 << 20))
except OSError as e:
    out["big"] = e.errno
os.remove("big")
written = 0
try:
    for i in range(1000):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * ((1 << 20) - 4096))
        written += (1 << 20) - 4096
except OSError as e:
    out["many"] = e.errno
out["written_mb"] = written / (1 << 20)
print(json.dumps(out))
"""
    out = run_hostile(code)
    # 27: EFBIG (the 1 MB file-size limit); 28: ENOSPC (the 16 MB tmpfs is full)
    assert out["big"] == 27 and out["many"] == 28
    assert 14 <= out["written_mb"] <= 16
    # the call that fills the disk without catching the error ends cleanly, as an error observation
    obs = python_tool.step("python: open('more', 'wb').write(b'x' * 900000)").observation
    assert obs == "error: OSError: [Errno 28] No space left on device\n"
    assert python_tool.step("python: print(6 * 7)").observation == "output: 42\n"
