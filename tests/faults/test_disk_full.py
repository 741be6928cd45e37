"""A disk that fills up under a run: the run directory (weights, checkpoints, logs) on a real
2.5 MB tmpfs mounted by the test (the suite runs as root in its container), the tiny model's
learner publishing versions (~280 KB each) and checkpointing every 2 steps (~1 MB each),
simulated generators, a real redis-server. The checkpoint of step 2 fits, a later write does not:
`rollctl run` ends with exit code 4 and one line, no traceback, the lease given back; once there
is space again (the tmpfs grown in place), the same command resumes from that checkpoint with
nothing lost and nothing trained twice (the ledger audit)."""

from __future__ import annotations

import subprocess

import pytest
import redis
from harness import rollctl_run, write_config
from test_learner_stop import _audit_and_finish

from rollflash.broker.connect.keys import RunKeys

STEPS, B = 20, 4


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(disk)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_ends_the_run_with_one_line_and_the_same_command_resumes(
    tmp_path, small_disk, redis_url, run_id, tiny_model_dir
):
    sim = {"per_token_s": 0.001, "length_median": 8, "learner_step_s": 0, "vocab_size": 51}
    run_dir = small_disk / "run"
    config = write_config(
        tmp_path, redis_url, run_id, STEPS, B, sim=sim, model={"path": str(tiny_model_dir)},
        rollout={"max_new_tokens": 16}, trainer={"checkpoint_every": 2},
        run={"run_id": run_id, "run_dir": str(run_dir), "torch_threads": 1},
    )  # fmt: skip
    full = rollctl_run(config)
    assert full.returncode == 4, full.stdout[-2000:] + full.stderr[-2000:]
    assert "Traceback" not in full.stdout + full.stderr
    assert full.stderr.strip().splitlines()[-1] == (
        "learner exited with 4: disk full: no space left on the device; free space and run the "
        "same command (nothing is lost: the run resumes from its last checkpoint)"
    )
    r = redis.Redis.from_url(redis_url)
    assert not r.exists(RunKeys(run_id).lease)
    latest = int((run_dir / "checkpoints" / "LATEST").read_text())
    assert 0 < latest < STEPS

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = rollctl_run(config)
    assert again.returncode == 0, again.stderr[-3000:]
    _audit_and_finish(r, run_id, run_dir, [latest], STEPS)
