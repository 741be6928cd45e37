"""deploy/slurm/rollflash.sbatch on a one-node Slurm cluster the test starts
(tests/helpers/slurm_cluster.py): the sim engine end to end through `sbatch` (Redis, the learner
and two generators as job steps of one job), and `scancel` of one generator's step mid-run: the
run trains to its end with the other, nothing trained twice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from harness import steps_done, trained_ids, wait_until, write_config  # noqa: E402

from tests.helpers.slurm_cluster import SlurmCluster, unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, B = 8, 4


@pytest.fixture
def slurm(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path / "slurm")
    try:
        why = cluster.start()
        if why:
            pytest.skip(why)
        yield cluster
    finally:
        cluster.stop()


def test_sbatch_runs_the_sim_engine_and_survives_scancel_of_a_generator_step(slurm, tmp_path):
    run_dir = tmp_path / "run"
    # redis.url is the sbatch script's: it starts Redis as a step and passes --redis-url
    config = write_config(tmp_path, "redis://unused:1/0", "slurm", STEPS, B)
    env = {
        "ROLLCTL": f"{sys.executable} -m rollflash.rollctl.cli",
        "RUN_DIR": str(run_dir),
        "GENERATORS_PER_NODE": "2",
        "REDIS_BIND": "127.0.0.1",
        "REDIS_PORT": str(_free_port()),
    }
    out = tmp_path / "job.out"
    job = slurm.sbatch(
        "-o", str(out), "--chdir", str(ROOT), str(ROOT / "deploy/slurm/rollflash.sbatch"),
        str(config), env=env,
    )  # fmt: skip
    try:
        # a learner and two generators importing torch on a loaded 2-core machine
        wait_until(lambda: steps_done(run_dir) >= 2, 240, "two learner steps")
        steps = slurm.steps(job)
        assert {"redis", "learner"} <= set(steps), steps
        gens = sorted(n for n in steps if n.startswith("gen-"))
        assert len(gens) == 2, steps
        cancelled_at = steps_done(run_dir)
        slurm.scancel(steps[gens[0]])
        wait_until(lambda: gens[0] not in slurm.steps(job), 30, "the generator step to end")
        wait_until(lambda: not slurm.running(job), 300, "the job to end")
    finally:
        slurm.scancel(job)
    log = out.read_text()
    trained = trained_ids(run_dir)
    assert cancelled_at < STEPS, "the run ended before the cancel: nothing was tested"
    assert steps_done(run_dir) == STEPS, log[-3000:]
    assert len(trained) == len(set(trained)) == STEPS * B  # every step complete, none twice
    assert "rollctl: error" not in log, log[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
