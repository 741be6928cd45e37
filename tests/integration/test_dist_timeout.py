"""A stalled rank ends its peers' waits: two gloo ranks (tests/integration/stall_worker.py, real
processes with the environment torchrun gives them, built through learner/build.py), rank 1
stops itself with SIGSTOP and rank 0's training step fails within `trainer.dist_timeout_s`, with
one line naming the rank and the collective, and the process exits instead of hanging."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("stall_worker.py")
TIMEOUT_S = 3.0
# the margin covers a busy 2-core machine; the point is that the wait ends near the timeout,
# not after torch's default of 30 minutes
MARGIN_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stalled_rank_ends_the_other_with_one_line_naming_rank_and_operation(tiny_model_dir):
    env = {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tiny_model_dir), str(TIMEOUT_S)],
            cwd=ROOT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, err = ranks[0].communicate(timeout=240)
    finally:
        os.kill(ranks[1].pid, signal.SIGKILL)
        ranks[1].wait()
    assert ranks[0].returncode == 1, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["type"] == "CollectiveTimeout"
    (line,) = report["error"].splitlines()  # one line
    assert line.startswith("rank 0 of 2: all_reduce (Dist.sums) ended after waiting")
    assert "trainer.dist_timeout_s = 3 s" in line and "another rank stalled or died" in line
    assert TIMEOUT_S <= report["waited_s"] < TIMEOUT_S + MARGIN_S
