"""Learning health (learner/metrics/health.py) in real runs of `rollctl run`: on a task built so that
the majority answer is right 80% of the time, a model that gives it to everything (built by SFT
on that answer alone) is flagged at the first evaluation after training starts, and the run
says so in its log and its summary; a run that learns (the demo's warm start on addition, the
README's own-data run) is not."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import build_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _rows(path: Path, n: int, answer, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": answer(i, a, b)}) + "\n")


@pytest.fixture(scope="module")
def majority_data(tmp_path_factory) -> Path:
    """Train rows all answered "1"; 100 held-out rows, 80 answered "1" and 20 "2"."""
    d = tmp_path_factory.mktemp("majority")
    _rows(d / "train.jsonl", 400, lambda i, a, b: "1", 0)
    _rows(d / "test.jsonl", 100, lambda i, a, b: "1" if i % 5 else "2", 1)
    return d


@pytest.fixture(scope="module")
def collapsed_model(tmp_path_factory, majority_data) -> Path:
    """A tiny model that answers "1" to everything: SFT on the train rows, no teacher error."""
    params = {
        "path": str(majority_data / "train.jsonl"),
        "eval_path": str(majority_data / "test.jsonl"),
    }
    return build_model(
        tmp_path_factory,
        "collapsed",
        ["--task", "dataset", "--task-params", json.dumps(params), "--sft-steps", "80"]
        + ["--layers", "1", "--hidden", "64", "--sft-teacher-error", "0", "--seed", "0"],
    )


def _run(tmp_path: Path, config: dict) -> tuple[dict, list[dict], str]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    run_dir = Path(config["run"]["run_dir"])
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), rows, out.stdout


def _config(tmp_path, model, data, steps, every) -> dict:
    return {
        "run": {"run_id": "health", "run_dir": str(tmp_path / "run")},
        "model": {"path": str(model)},
        "task": {
            "name": "dataset",
            "params": {"path": str(data / "train.jsonl"), "eval_path": str(data / "test.jsonl")},
        },
        "reward": {"functions": ["exact"]},
        "rollout": {"num_return_sequences": 4, "max_new_tokens": 4},
        "trainer": {"rollout_batch_size": 8, "total_steps": steps},
        "eval": {"every": every, "size": 100},
    }


def test_a_run_collapsed_to_the_majority_answer_is_flagged(
    tmp_path, collapsed_model, majority_data
):
    summary, rows, stdout = _run(tmp_path, _config(tmp_path, collapsed_model, majority_data, 2, 1))
    # "1" everywhere: right on the 80 rows answered "1", which is what always answering "1" gets
    assert summary["heldout_acc_before"] == summary["heldout_acc_after"] == 0.8
    assert summary["heldout_top_answer_share_after"] == 1.0
    assert summary["heldout_top_answer_acc_after"] == 0.8
    (warning,) = summary["health_warnings"]  # once, when it started: at step 1's evaluation
    assert warning.startswith(
        "step 1: held-out accuracy 0.800 is no better than always answering '1'"
    )
    assert f"learning health: {warning}" in stdout  # the learner's log line, echoed
    assert [r["health/majority"] for r in rows] == [1.0, 1.0]
    # the step's share of groups that answer alike is logged (sampled at temperature 1, this
    # model's groups are not all "1": the greedy answer is what collapsed)
    assert all(0 <= r["health/same_answer_frac"] <= 1 for r in rows)


def test_a_run_that_learns_is_not_flagged(tmp_path, warm_model_dir):
    """The README's own-data run (addition, the demo's warm start, 10 steps), evaluated every 5."""
    data = tmp_path / "data"
    data.mkdir()
    _rows(data / "train.jsonl", 2000, lambda i, a, b: str(a + b), 0)
    _rows(data / "test.jsonl", 100, lambda i, a, b: str(a + b), 1)
    config = _config(tmp_path, warm_model_dir, data, 10, 5)
    config["trainer"]["rollout_batch_size"] = 16
    config["rollout"]["num_return_sequences"] = 8
    summary, rows, _ = _run(tmp_path, config)
    assert summary["heldout_acc_after"] > summary["heldout_acc_before"]  # it learned
    assert summary["health_warnings"] == []
    evaluated = [r for r in rows if "eval/heldout_acc" in r]
    assert [r["step"] for r in evaluated] == [5, 10]
    for r in evaluated:
        assert r["health/majority"] == 0.0
        assert r["eval/top_answer_share"] < 0.2  # sums of 20..198: answers are spread
