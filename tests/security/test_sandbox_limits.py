"""The sandbox's bounds per call, not per process (envs/_cgroup.py): a memory bomb spread over 16
processes of one call, measured from outside; the bound each host gets (a cgroup per call where
one can be made, else one process per call), and the scratch archive the caller holds.

Each test runs twice: with the host's cgroup per call (skipped, saying why, on a host that
delegates none), and with ROLLFLASH_SANDBOX_CGROUP=off, the bound of such a host."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from sandbox_harness import HOOK_OFF, SKIP_SANDBOX

from rollflash.envs._bwrap import MARKER
from rollflash.envs._cgroup import OFF_ENV, per_call_bound
from rollflash.envs.sandbox import STATE_SLACK, Sandbox, SandboxLimits
from rollflash.envs.tools import ToolUse

pytestmark = SKIP_SANDBOX

LIMIT_MB = 256
SLACK_MB = 32  # what the sampling adds: the init's pages (charged before it joined the cgroup)


@pytest.fixture(params=["cgroup", "rlimits"])
def bound(request, monkeypatch):
    if request.param == "rlimits":
        monkeypatch.setenv(OFF_ENV, "off")
    else:
        monkeypatch.delenv(OFF_ENV, raising=False)
    per_call_bound.cache_clear()
    found = per_call_bound()
    if request.param == "cgroup" and found.kind == "rlimits":
        pytest.skip(f"this host gives no cgroup per call: {found.why}")
    yield found
    per_call_bound.cache_clear()


def _sandbox_memory_mb() -> float:
    """Proportional anonymous and shared (tmpfs) memory of every sandboxed process, in MB:
    PSS, so pages a fork shares with its parent are counted once."""
    total_kb = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARKER.encode() not in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines():
                if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                    total_kb += int(line.split()[1])
        except (OSError, ValueError):
            continue  # the process ended while being read
    return total_kb / 1024


# 16 processes (the code and 15 forks) each try to hold 64 MB, 1 GB in all, then sleep
BOMB = """
children = 0
for _ in range(15):
    try:
        if os.fork() == 0:
            break
        children += 1
    except OSError as e:
        print(json.dumps({"fork_refused": e.errno}), flush=True)
        break
held = []
try:
    for _ in range(8):
        held.append(b"x" * (8 << 20))
except MemoryError:
    pass
import time
time.sleep(30)
"""


def test_a_memory_bomb_across_16_processes_stays_under_the_calls_limit(bound):
    """Without a per-call bound the bomb holds 16 x 64 MB = 1 GB. With a cgroup the kernel kills
    processes of the call at 256 MB (the call ends with that reason); without one no fork is
    allowed and the one process holds its 64 MB until the wall clock ends it."""
    tool = ToolUse(max_turns=10, cpu_s=20, wall_s=6.0, memory_mb=LIMIT_MB)
    tool.reset(0)
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _sandbox_memory_mb())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        observation = tool.step("python: " + HOOK_OFF + BOMB).observation
    finally:
        stop.set()
        sampler.join()
        tool.close()
    assert peak[0] < LIMIT_MB + SLACK_MB, peak[0]
    assert peak[0] > 48, peak[0]  # the sampler saw the bomb: at least one process's worth
    if bound.kind == "rlimits":  # the first fork failed (EAGAIN), the one process slept on
        assert observation == "error: timeout after 6s wall clock\n", observation
    else:
        assert observation == f"error: memory limit of {LIMIT_MB} MB exceeded\n", observation


def test_the_bound_in_force_is_the_one_reported(bound):
    """The line logged at start (`describe_bound`) says which bound holds, and it is the one the
    code meets: its own cgroups, threads and forks allowed; or one process, no thread."""
    tool = ToolUse(max_turns=10, wall_s=10.0)
    tool.reset(0)
    observation = tool.step(
        "python: "
        + HOOK_OFF
        + """
import threading
cgroups = sorted(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup"))
try:
    threading.Thread(target=lambda: None).start()
    thread = "started"
except RuntimeError as e:
    thread = str(e)
print(json.dumps({"cgroups": cgroups, "thread": thread}))
"""
    ).observation
    tool.close()
    out = json.loads(observation.removeprefix("output: "))
    if bound.kind == "rlimits":
        assert "ROLLFLASH_SANDBOX_CGROUP=off" in bound.describe()
        assert out["thread"] == "can't start new thread"
        assert not any("rollflash-sandbox" in c for c in out["cgroups"])
    else:
        assert f"own {bound.kind} cgroup" in bound.describe()
        assert out["thread"] == "started"
        # v1: the memory and pids hierarchies; v2: the one unified path
        inside = [c for c in out["cgroups"] if "rollflash-sandbox" in c]
        assert len(inside) == (2 if bound.kind == "cgroup1" else 1), out["cgroups"]


def test_the_scratch_archive_the_caller_keeps_is_bounded(bound):
    """The code can write its own archive on the state pipe (descriptor 3) and skip the child's:
    the caller keeps at most disk_mb + STATE_SLACK bytes of it, and keeps the previous files
    when it is larger."""
    disk_mb = 1
    box = Sandbox(SandboxLimits(wall_s=20.0, disk_mb=disk_mb), audit_hook=False)
    assert box.run("open('keep', 'w').write('x' * 100)").ok
    before = box._state
    bound_bytes = (disk_mb << 20) + STATE_SLACK

    def forge(size: int) -> None:
        box.run(
            f"import os\nview = memoryview(({size}).to_bytes(8, 'little') + bytes({size}))\n"
            "while view:\n    view = view[os.write(3, view):]\nos._exit(0)"
        )

    for size in (2 * (disk_mb << 20), bound_bytes + 1):  # 2 MB: what was kept before
        forge(size)
        assert box._state == before, size
    forge(bound_bytes)  # the largest archive kept (opaque here: the next call unpacks it)
    assert len(box._state) == bound_bytes
    box.close()
