"""A dataset with a bad row stops `rollctl run` with one line naming the file, the line and the
column: before anything starts when the row is among those the preflight samples
(rollctl/preflight.py), else at the learner's start, which checks every row: no traceback, no
weights published, no training step (`on_bad_row: skip` is tests/unit/test_dataset_rows.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflash.rollctl.preflight import PREFLIGHT_DONE_ENV

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, model: Path, redis_url: str, run_id: str, *sets: str, env=None):
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
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    return out, run_dir


def _bad_file(tmp_path: Path) -> Path:
    rows = [{"question": f"{i}+1=", "answer": f"#### {i + 1}"} for i in range(12)]
    rows[6] = {"answer": "#### 7"}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_bad_row_stops_the_run_before_anything_starts_in_one_line(
    tmp_path, tiny_model_dir, redis_url, run_id
):
    path = _bad_file(tmp_path)
    out, run_dir = _run(tmp_path, tiny_model_dir, redis_url, run_id)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.splitlines() == [f"rollctl: error: {path}:7: no 'question'"]
    assert not run_dir.exists()  # no process started


def test_the_learner_finds_a_bad_row_the_preflight_did_not_read(
    tmp_path, tiny_model_dir, redis_url, run_id
):
    path = _bad_file(tmp_path)  # as if the row were beyond the preflight's sample
    out, run_dir = _run(tmp_path, tiny_model_dir, redis_url, run_id, env={PREFLIGHT_DONE_ENV: "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    line = f"rollctl: error: {path}:7: no 'question'"
    assert f"learner exited with 2: {line}; see" in out.stderr
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.strip().splitlines()[-1] == line and "Traceback" not in log
    assert not list((run_dir / "weights").glob("v*"))  # not even v0: nothing was trained
    assert not (run_dir / "metrics.jsonl").exists()


BAD_ROWS = {
    # 20,000 nested lists crash the Arrow JSON reader (SIGSEGV) if they reach it
    "deep": (
        b'{"question": "1+1=", "answer": "#### 2", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        "JSON nested deeper than 63 levels",
    ),  # fmt: skip
    "utf8": (
        b'{"question": "1+\xff=", "answer": "#### 2"}',
        "not valid UTF-8 (byte 0xff at column 17)",
    ),
    "big": (
        json.dumps({"question": "1" * (100 << 20), "answer": "#### 2"}).encode(),
        "a row longer than 16777216 bytes (task.params.max_row_bytes)",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_a_row_the_readers_cannot_take_stops_the_run_in_one_line(
    tmp_path, tiny_model_dir, redis_url, run_id, kind
):
    row, problem = BAD_ROWS[kind]
    rows = [
        json.dumps({"question": f"{i}+1=", "answer": f"#### {i + 1}"}).encode() for i in range(12)
    ]
    rows.insert(6, row)
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"".join(r + b"\n" for r in rows))
    line = f"rollctl: error: {path}:7: {problem}"
    # the preflight samples the first rows with the learner's line checks: the same one line,
    # before anything starts
    out, run_dir = _run(tmp_path, tiny_model_dir, redis_url, run_id)
    assert (out.returncode, out.stderr.strip()) == (2, line) and not run_dir.exists()
    # and the learner's own load stops on it too (the preflight samples, the learner reads all)
    out, run_dir = _run(tmp_path, tiny_model_dir, redis_url, run_id, env={PREFLIGHT_DONE_ENV: "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"learner exited with 2: {line}; see" in out.stderr and "Traceback" not in out.stderr
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.strip().splitlines()[-1] == line and "Traceback" not in log
    assert not list((run_dir / "weights").glob("v*"))
