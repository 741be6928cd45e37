"""deploy/slurm/rollflash.sbatch on a one-node Slurm cluster the test starts
(tests/helpers/slurm_cluster.py): the sim engine end to end through `sbatch` (Redis, the learner
and two generators as job steps of one job), and `scancel` of one generator's step mid-run: the
run trains to its end with the other, nothing trained twice. Then the README's one-liner as
written (no RUN_DIR; `--gpus-per-node` on a node whose GPUs Slurm manages: device files of the
test's own, no GPU exists here) with two generators: each process gets GPUs of its own, read
from its own environment (/proc/PID/environ) and from the job's output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from harness import steps_done, trained_ids, wait_until, write_config  # noqa: E402

from tests.helpers.slurm_cluster import SlurmCluster, unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, B = 8, 4


def _cluster(directory: Path, gpus: int = 0):
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(directory, gpus=gpus)
    try:
        why = cluster.start()
        if why:
            pytest.skip(why)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(tmp_path):
    yield from _cluster(tmp_path / "slurm")


@pytest.fixture
def gpu_slurm(tmp_path):
    yield from _cluster(tmp_path / "slurm", gpus=3)


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


def test_the_readme_one_liner_gives_each_generator_its_own_gpus(gpu_slurm, tmp_path):
    """`sbatch --nodes=1 --gpus-per-node=3 rollflash.sbatch run.yaml` with two generators on the
    learner's node: the generators take the last GPUs, one each, and the learner the rest."""
    config = write_config(tmp_path, "redis://unused:1/0", "slurm-gpus", STEPS, B)
    env = {
        "ROLLCTL": f"{sys.executable} -m rollflash.rollctl.cli",
        "GENERATORS_PER_NODE": "2",
        "REDIS_BIND": "127.0.0.1",
        "REDIS_PORT": str(_free_port()),
    }
    out = tmp_path / "job.out"
    job = gpu_slurm.sbatch(
        "-o", str(out), "--chdir", str(ROOT), "--nodes=1", "--gpus-per-node=3",
        str(ROOT / "deploy/slurm/rollflash.sbatch"), str(config), env=env,
    )  # fmt: skip
    try:
        wait_until(lambda: len(_gpus_seen(config)) == 3, 240, "the learner and two generators")
        seen = _gpus_seen(config)
        wait_until(lambda: not gpu_slurm.running(job), 300, "the job to end")
    finally:
        gpu_slurm.scancel(job)
    host = gpu_slurm.host
    # 3 GPUs, 2 generators of 1 GPU on the learner's node: generators 1 and 2, the learner 0
    assert seen == {"learner": "0", f"gen-{host}-0": "1", f"gen-{host}-1": "2"}, seen
    log = out.read_text()
    for name, gpus in seen.items():
        assert f"{name} on " in log and f": CUDA_VISIBLE_DEVICES={gpus}" in log, log[-3000:]
    run_dir = tmp_path / "run"  # run.run_dir of the config: the started Redis's home
    assert (run_dir / "redis" / "password").is_file()
    assert steps_done(run_dir) == STEPS, log[-3000:]
    assert "rollctl: error" not in log and "rollflash.sbatch:" not in log, log[-3000:]


def _gpus_seen(config: Path) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of each running learner and generator process of `config` (the
    Python process ROLLCTL starts), as it was started with it (its /proc environ): name ->
    GPUs."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
            if str(config) not in args or not {"start-learner", "start-generator"} & set(args):
                continue
            if args[0] != sys.executable:  # srun, the step's bash before its exec
                continue
            environ = (proc / "environ").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue  # not a process, or one that ended meanwhile
        name = args[args.index("--id") + 1] if "start-generator" in args else "learner"
        values = [e.split("=", 1)[1] for e in environ if e.startswith("CUDA_VISIBLE_DEVICES=")]
        out[name] = values[0] if values else ""
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
