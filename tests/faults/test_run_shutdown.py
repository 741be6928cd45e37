"""`rollctl run` leaves no process behind: on Ctrl-C (SIGINT to its process group) and when it is
itself killed with SIGKILL, the learner, the generators and the embedded redis-server all exit."""

import os
import signal
import subprocess
import sys
import time

import pytest


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _as_a_terminal_does() -> None:
    """preexec_fn: SIGINT at its default, as a shell starts a foreground job; a test run started
    in the background by a script (`make test &`) inherits SIGINT ignored, and Python keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _start(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--generators",
            "2",
            "--set",
            f"run.run_dir={tmp_path / 'run'}",
            "--set",
            "rollout.engine=sim",
            "--set",
            "sim.learner_step_s=0.5",
            "--set",
            "trainer.total_steps=1000",
            "--set",
            "eval.size=1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_as_a_terminal_does,
    )
    deadline = time.monotonic() + 600  # start-up on a loaded machine: bounds a hang only
    while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.2)  # wait until training is under way: learner, generators, redis all up
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    return proc


def _gone(pids, timeout_s=120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
        ]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


@pytest.mark.parametrize("how", ["ctrl-c", "kill-9"])
def test_everything_stops(tmp_path, how):
    proc = _start(tmp_path)
    sid = os.getsid(proc.pid)
    children = _children_of(proc.pid)
    assert len(children) >= 4  # redis-server, learner, 2 generators
    if how == "ctrl-c":
        os.killpg(sid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(timeout=60)
    else:
        proc.kill()
        proc.wait()
    assert _gone(children) == [], f"orphans left after {how}"
    assert _gone(_session_pids(sid)) == []


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the foreground process group: `rollctl run`, its children
    and, but for its own group, the embedded redis-server) ends the run with exit code 130 and
    one line on stderr, and the embedded Redis still writes its snapshot for the resume."""
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--generators", "1"]
        + ["--set", f"run.run_dir={tmp_path / 'run'}", "--set", "rollout.engine=sim"]
        + ["--set", "sim.learner_step_s=0.5", "--set", "trainer.total_steps=1000"]
        + ["--set", "eval.size=1"],
        stdout=out,
        stderr=err,
        start_new_session=True,
        preexec_fn=_as_a_terminal_does,
    )
    deadline = time.monotonic() + 600  # start-up on a loaded machine: bounds a hang only
    while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.2)  # training under way
    os.killpg(os.getsid(proc.pid), signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert (tmp_path / "err").read_text().splitlines() == [
        "rollctl: interrupted; stopped the learner and 1 generator(s) (the same command "
        "resumes the run)"
    ]
    assert "Traceback" not in (tmp_path / "out").read_text()
    assert (tmp_path / "run" / "redis" / "dump.rdb").is_file()
