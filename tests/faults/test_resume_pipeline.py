"""A resumed learner keeps the pipeline as full as a fresh one (learner/build.py
`rebase_admission`): `rollctl run` killed with kill -9 and run again resumes from its checkpoint
on a new embedded Redis, which holds none of the prompts the dead run had in flight; the first
step after the resume issues (1 + async_ratio) x B prompts, as a fresh run's first step does, and
later steps train samples one version old again. And one killed before its first checkpoint
runs again from the initial weights. Real processes (learner, 2 simulated generators,
redis-server) through `rollctl run`."""

import json
import os
import signal
import subprocess
import sys
import time

B, RATIO, CKPT = 4, 1, 5


def _run(tmp_path, steps: int, every: int = CKPT) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *[sys.executable, "-m", "rollflash.rollctl.cli", "run", "--generators", "2"],
            *["--set", f"run.run_dir={tmp_path / 'run'}", "--set", "run.torch_threads=1"],
            *["--set", "rollout.engine=sim", "--set", "rollout.num_return_sequences=2"],
            *["--set", "rollout.max_new_tokens=64", "--set", "rollout.prompts_per_pull=1"],
            *["--set", "sim.per_token_s=0.001", "--set", "sim.length_median=16"],
            *["--set", "sim.length_sigma=0.3", "--set", "sim.learner_step_s=0.3"],
            *["--set", f"trainer.rollout_batch_size={B}", "--set", f"trainer.async_ratio={RATIO}"],
            *[
                "--set",
                f"trainer.checkpoint_every={every}",
                "--set",
                f"trainer.total_steps={steps}",
            ],
            *["--set", "trainer.wait_timeout_s=60", "--set", "eval.size=1"],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _rows(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_run_killed_and_run_again_resumes_with_its_prompts_in_flight(tmp_path):
    first = _run(tmp_path, steps=14)
    deadline = time.monotonic() + 120
    while len(_rows(tmp_path)) < CKPT + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_rows(tmp_path)) >= CKPT + 2, "the first run did not get past its checkpoint"
    os.killpg(first.pid, signal.SIGKILL)  # rollctl run, learner, generators, redis-server
    first.wait()
    fresh = _rows(tmp_path)
    second = _run(tmp_path, steps=14)
    assert second.wait(timeout=180) == 0
    rows = _rows(tmp_path)
    # resumed from the checkpoint of step 5: steps 6.. again, on a Redis that starts empty;
    # metrics.jsonl keeps the first run's rows of steps 1-5 and the new ones, each step once
    assert [r["step"] for r in rows] == list(range(1, 15)) and rows[:CKPT] == fresh[:CKPT]
    resumed = rows[CKPT:]
    # the first step issues B prompts for itself and async_ratio x B ahead, as step 1 did
    assert fresh[0]["async/prompts_issued"] == (1 + RATIO) * B
    assert resumed[0]["async/prompts_issued"] == (1 + RATIO) * B
    assert sum(r["async/prompts_issued"] for r in resumed) >= len(resumed) * B + RATIO * B
    # with async_ratio x B prompts ahead the learner trains samples one version old again;
    # with only B in flight every group would be generated after the step before it (staleness 0)
    assert sum(r["async/staleness_max"] for r in resumed[1:6]) > 0, resumed[:6]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["steps_this_process"] == 14 - CKPT
    # the summary covers the whole run: steps 1-10 of the surviving lineage (1-5 from before)
    first10 = [r["reward/mean"] for r in fresh[:CKPT]] + [r["reward/mean"] for r in resumed[:5]]
    assert summary["reward_first10"] == round(sum(first10) / 10, 4)


def test_a_run_killed_before_its_first_checkpoint_runs_again_to_the_end(tmp_path):
    """`rollctl run` killed with kill -9 (learner, generators and Redis with it) after v0 and
    two steps were published and logged, before the first checkpoint (at step 6, the end): the
    run directory holds weights and no checkpoint. Running it again starts from the initial
    weights at step 0 (nothing was durable), publishes after the versions already there, and
    completes: every step once in metrics.jsonl, the dead steps' rows cut."""
    first = _run(tmp_path, steps=6, every=6)
    deadline = time.monotonic() + 120
    while len(_rows(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_rows(tmp_path)) >= 2, "the first run did not log two steps"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints" / "LATEST").exists()
    versions = sorted(int(p.parent.name[1:]) for p in run_dir.glob("weights/v*/manifest.json"))
    assert versions and versions[0] == 0
    second = _run(tmp_path, steps=6, every=6)
    assert second.wait(timeout=180) == 0, (run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, 7))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["steps_this_process"] == 6
    # v0 .. v(k) of the dead learner, then the initial weights again as v(k + 1), then 6 steps
    assert summary["final_version"] >= versions[-1] + 1 + 6
    assert (
        "resumed from no checkpoint (the initial weights): step 0"
        in (run_dir / "logs" / "learner.log").read_text()
    )
