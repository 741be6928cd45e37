"""How envs/_cgroup.py reads a host's cgroups and picks the per-call bound. The kernel's files are
stood in for by plain files under tmp_path: this checks the parsing and the decisions (which
hierarchy, when a v2 cgroup may delegate to itself), not what the kernel enforces; that is
tests/security/test_sandbox_limits.py, on the host's own cgroups."""

from __future__ import annotations

import os

from rollflash.envs import _cgroup
from rollflash.envs._cgroup import CallBound, CallGroup

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_SELF = "8:pids:/\n4:memory:/jobs/a1\n1:cpu,cpuacct:/\n0::/\n"


def test_hierarchies_and_own_paths_of_a_hybrid_host():
    mounts = _cgroup._mounts(HYBRID)
    assert mounts == {
        "memory": ("/sys/fs/cgroup/memory", "/"),
        "pids": ("/sys/fs/cgroup/pids", "/"),
        "": ("/sys/fs/cgroup/unified", "/"),
    }
    paths = _cgroup._own_paths(HYBRID_SELF)
    assert paths == {"pids": "/", "memory": "/jobs/a1", "cpu": "/", "cpuacct": "/", "": "/"}
    assert str(_cgroup._directory(mounts["memory"], paths["memory"])) == (
        "/sys/fs/cgroup/memory/jobs/a1"
    )
    # a mount of a sub-tree (a container's view): the path is taken relative to its root
    assert str(_cgroup._directory(("/sys/fs/cgroup", "/jobs"), "/jobs/a1")) == "/sys/fs/cgroup/a1"


def _v2_tree(tmp_path, subtree: str, procs: list[int]):
    own = tmp_path / "svc"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text(subtree)
    (own / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    return {"": (str(tmp_path), "/")}, {"": "/svc"}, own


def test_a_v2_cgroup_with_controllers_for_its_children_is_used(tmp_path):
    mounts, paths, own = _v2_tree(tmp_path, "memory pids\n", [1, 2])
    assert _cgroup._v2(mounts, paths) == CallBound("cgroup2", (str(own),))


def test_a_v2_process_alone_in_its_cgroup_delegates_to_itself(tmp_path):
    """As systemd's delegation asks: move into a leaf child, then enable memory and pids."""
    mounts, paths, own = _v2_tree(tmp_path, "", [os.getpid()])
    assert _cgroup._v2(mounts, paths) == CallBound("cgroup2", (str(own),))
    assert (own / "rollflash-sandbox-leaf" / "cgroup.procs").read_text() == str(os.getpid())
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_a_v2_cgroup_shared_with_other_processes_falls_back(tmp_path):
    mounts, paths, own = _v2_tree(tmp_path, "", [os.getpid(), 1])
    why = _cgroup._v2(mounts, paths)
    assert (
        why
        == f"cgroup v2: {own} holds other processes, so it cannot enable controllers for children"
    )
    (own / "cgroup.controllers").write_text("cpu\n")
    assert "offers no memory and pids" in _cgroup._v2(mounts, paths)


def test_a_call_group_writes_its_limits_and_reads_oom_kills(tmp_path):
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    memory.mkdir(), pids.mkdir()
    group = CallGroup(CallBound("cgroup1", (str(memory), str(pids))), 256, 17)
    mem_dir, pids_dir = group.dirs
    assert (mem_dir / "memory.limit_in_bytes").read_text() == str(256 << 20)
    assert (pids_dir / "pids.max").read_text() == "17"
    (mem_dir / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert group.oom_kills() == 3
    for d in group.dirs:  # stand-ins for the kernel's files, which rmdir ignores
        for f in d.iterdir():
            f.unlink()
    group.close()
    assert not mem_dir.exists() and not pids_dir.exists()


def test_switched_off_it_is_the_rlimits_bound(monkeypatch):
    monkeypatch.setenv(_cgroup.OFF_ENV, "off")
    _cgroup.per_call_bound.cache_clear()
    try:
        bound = _cgroup.per_call_bound()
    finally:
        _cgroup.per_call_bound.cache_clear()
    assert bound == CallBound("rlimits", why="ROLLFLASH_SANDBOX_CGROUP=off")
    assert "one process (RLIMIT_NPROC 1)" in bound.describe()
