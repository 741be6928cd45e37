"""An agent program trained through the generators' OpenAI-compatible endpoint
(docs/agentic.md, "Agent programs"): configs/agent_game.yaml, shortened, with real processes and
Redis. examples/guess_sum.py plays a two-guess addition game with the official openai client
(completions API) on the demo's warm start; its held-out success (a right first guess, measured
by the learner running the same program greedily) must rise, and the behaviour log-probabilities
the endpoint recorded must be the learner's own on the first, on-policy step: the trained
sequences are the tokens the engine saw."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


@pytest.mark.slow
def test_agent_program_learns_the_guessing_game(tmp_path, redis_url, run_id, warm_model_dir):
    run_dir = tmp_path / "run"
    sets = {
        "model.path": warm_model_dir,
        "run.run_dir": run_dir,
        "run.run_id": run_id,
        "trainer.total_steps": STEPS,
        "eval.every": 0,
        "eval.size": 100,
    }
    out = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config",
         str(ROOT / "configs" / "agent_game.yaml"), "--redis-url", redis_url, "--generators", "1",
         *[f"--set={k}={v}" for k, v in sets.items()]],
        capture_output=True, text=True, timeout=900, cwd=ROOT,  # `examples` is importable there
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == STEPS and s["heldout_size"] == 100
    # measured over run seeds 0, 1, 2 (this config, 10 steps): 0.26 -> 0.77, 0.80, 0.77
    assert s["heldout_acc_after"] >= s["heldout_acc_before"] + 0.3, s
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(m for m in metrics if m.get("step") == 1 and "mismatch/abs_dlogp_mean" in m)
    # step 1 trains on samples of v0 with v0: measured about 4e-7 (float32 batch order)
    assert first["mismatch/abs_dlogp_mean"] < 1e-4, first
    assert all(m.get("env/errors", 0) == 0 for m in metrics)
    rows = [json.loads(x) for x in (run_dir / "eval_generations.jsonl").read_text().splitlines()]
    assert {r["eval"] for r in rows} == {"agent"} and len(rows) == 200  # before and after
