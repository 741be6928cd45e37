"""`make rg-demo`'s config (configs/rg_demo.yaml), shortened: real processes and Redis, the tiny
chat model warm-started on the config's reasoning-gym task by scripts/make_rg_model.py, a second
dataset mixed in, and every step's rewards recorded per dataset. That RL raises the held-out
accuracy is measured by the full run (docs/tasks.md, "reasoning-gym")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "rg_demo.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def rg_model(tmp_path_factory) -> Path:
    # a far shorter warm start than the Makefile's 1200 SFT steps: enough to write tagged
    # answers; this test checks the plumbing
    args = ["--config", str(CONFIG), "--sft-steps", "30", "--seed", "0"]
    return build_model(tmp_path_factory, "rg", args, script="make_rg_model.py")


@pytest.mark.slow
def test_rg_demo_records_rewards_per_dataset(tmp_path, redis_url, run_id, rg_model):
    run_dir = tmp_path / "run"
    sets = {
        "model.path": rg_model,
        "run.run_dir": run_dir,
        "run.run_id": run_id,
        "trainer.total_steps": STEPS,
        "trainer.rollout_batch_size": 16,
        "eval.every": 0,
        "eval.size": 20,
        # a second dataset, weighted as the first: a mixture of two domains
        "task.params.datasets.chain_sum": "{config: {min_terms: 2, max_terms: 2}}",
    }
    out = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(CONFIG),
         "--redis-url", redis_url, "--generators", "1",
         *[f"--set={k}={v}" for k, v in sets.items()]],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "reward/mean" in m]  # fmt: skip
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:  # both domains in every step (16 prompts at 1:1; each in 1 - 2^-15)
        for name in ("basic_arithmetic", "chain_sum"):
            # score_answer in [0, 1] plus the format reward 0.1
            assert 0.0 <= m[f"reward/{name}/mean"] <= 1.1, m
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("basic_arithmetic", "chain_sum"):  # evaluated per dataset, 10 items each
        assert 0.0 <= summary[f"{name}_heldout_acc_after"] <= 1.0, summary
    rows = [json.loads(x) for x in (run_dir / "eval_generations.jsonl").read_text().splitlines()]
    assert {r["id"].split("/")[0] for r in rows} == {"basic_arithmetic", "chain_sum"}
    assert rows[0]["prompt"].startswith("<|user|>") and rows[0]["prompt"].endswith("<|assistant|>")
