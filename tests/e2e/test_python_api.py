"""`from rollflash import Run`: the demo trained for a few steps from a Python script, as from a
notebook, with its reward given as a lambda. The lambda runs in the script's own process (it
counts its calls there), and the rewards the learner trained on are the lambda's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from rollflash import Run

calls = []
result = Run(
    sys.argv[1],
    model={"path": sys.argv[2]},
    run={"run_dir": sys.argv[3]},
    trainer={"total_steps": 2, "rollout_batch_size": 4},
    rollout={"num_return_sequences": 4},
    eval={"size": 4},
    reward={"functions": [lambda prompt, response, answer, **row: calls.append(prompt) or 0.25]},
).train()
print(json.dumps({"calls": len(calls), "summary": result.summary, "run_dir": str(result.run_dir)}))
"""


def test_the_python_api_trains_the_demo_with_a_lambda_reward(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    demo = ROOT / "configs" / "demo.yaml"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(demo), str(tiny_model_dir), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["run_dir"] == str(run_dir) and result["summary"]["steps"] == 2
    # every sample streamed was scored by the lambda, in this process: at least the 2 steps x 4
    # groups x 4 samples trained, besides the held-out evaluations
    assert result["calls"] >= 2 * 4 * 4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward/mean"] for row in rows] == [0.25, 0.25]  # the lambda's constant
    assert "python:lambda" in (run_dir / "run.yaml").read_text()
