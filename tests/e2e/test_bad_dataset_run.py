"""A dataset with a bad row stops `rollctl run` at the learner's start with one line naming the
file, the line and the column: no traceback, no weights published, no training step
(`on_bad_row: skip` is tests/unit/test_dataset_rows.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, model: Path, redis_url: str, run_id: str, *sets: str):
    run_dir = tmp_path / "run"
    args = [
        f"model.path={model}",
        "model.chat_template=none",
        f"task.params.path={tmp_path / 'train.jsonl'}",
        "task.params.eval_path=null",
        "task.params.heldout_size=2",
        f"run.run_dir={run_dir}",
        f"run.run_id={run_id}",
        "trainer.total_steps=1",
        "trainer.rollout_batch_size=4",
        "rollout.num_return_sequences=2",
        "eval.every=0",
        "eval.n_samples=0",
        *sets,
    ]
    out = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config",
         str(ROOT / "configs" / "byo_dataset.yaml"), "--redis-url", redis_url, "--generators",
         "1", *(f"--set={a}" for a in args)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return out, run_dir


def test_a_bad_row_stops_the_run_before_training_in_one_line(
    tmp_path, tiny_model_dir, redis_url, run_id
):
    rows = [{"question": f"{i}+1=", "answer": f"#### {i + 1}"} for i in range(12)]
    rows[6] = {"answer": "#### 7"}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, run_dir = _run(tmp_path, tiny_model_dir, redis_url, run_id)
    assert out.returncode == 2, out.stderr[-2000:]
    line = f"rollctl: error: {path}:7: no 'question'"
    assert f"learner exited with 2: {line}; see" in out.stderr
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.strip().splitlines()[-1] == line and "Traceback" not in log
    assert not list((run_dir / "weights").glob("v*"))  # not even v0: nothing was trained
    assert not (run_dir / "metrics.jsonl").exists()
