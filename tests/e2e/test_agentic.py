"""Agentic RL end to end: a tiny agent warm-started on a noisy teacher learns to solve more grid-world
episodes. Real processes (learner + 2 generators running multi-turn episodes), real Redis, the
shipped config (configs/agentic_gridworld.yaml) with fewer steps and GiGPO's step-level advantages,
so the loss mask and the per-turn records are exercised on the way.

In the documented runs (docs/agentic.md) the sampled success rate went from about 0.5 to 0.85 in
25 steps; the threshold here is lenient: +0.1 between the first and last five steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "agentic_gridworld.yaml"
STEPS = 20


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory) -> Path:
    """The config's warm start (its header gives the command), without the success evaluation."""
    out = tmp_path_factory.mktemp("agent") / "tiny-agent"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_tiny_agent_model.py"),
            "--out",
            str(out),
            "--task-params",
            '{"size": 3, "holes": 1, "max_turns": 6}',
            "--teacher-noise",
            "0.4",
            "--sft-steps",
            "200",
            "--max-positions",
            "128",
            "--eval-episodes",
            "0",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return out


@pytest.mark.slow  # SFT warm start and 20 steps: about 2.5 min on the shared 2 cores
def test_gridworld_success_rate_improves(tmp_path, redis_url, agent_model_dir, run_id):
    run_dir = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--config",
            str(CONFIG),
            "--redis-url",
            redis_url,
            "--set",
            f"model.path={agent_model_dir}",
            "--set",
            f"run.run_dir={run_dir}",
            "--set",
            f"run.run_id={run_id}",
            "--set",
            f"trainer.total_steps={STEPS}",
            "--set",
            "algo.adv_estimator=gigpo",
            "--set",
            "trainer.actor_lr=5.0e-4",
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=ROOT,
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    success = [m["reward/mean"] for m in metrics]  # reward 1 per solved episode, 0 otherwise
    first, last = sum(success[:5]) / 5, sum(success[-5:]) / 5
    assert last >= first + 0.1, success
    # greedy play on the held-out seeds does not collapse while sampled success rises: the warm
    # start already solves most of them greedily (1.0 in one full run, where 20 steps at lr 5e-4
    # and the staleness of a loaded machine left 0.797), so the bound is a collapse, not a rise
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] - 0.3, summary
    # episodes are multi-turn: a response holds several actions and the observations between them
    assert min(m["length/trained_mean"] for m in metrics) > 3 * 2, metrics[0]
