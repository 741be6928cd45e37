"""The small things an operator meets in a run with the tiny model: the config given as a pipe
(`--config <(...)`), no progress bars of transformers in the output or the logs, the final
evaluation made once when `total_steps` is a multiple of `eval.every`, `rollctl export
--run-dir`, and `rollctl status` of the finished run without `None`s and with its lag explained."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import yaml

STEPS, EVAL_SIZE = 2, 4


def _rollctl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_a_run_from_a_pipe_evaluates_once_shows_no_bars_and_exports(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    config = {
        "run": {"run_id": "details", "run_dir": str(run_dir), "torch_threads": 1},
        "model": {"path": str(tiny_model_dir)},
        "task": {"name": "arithmetic", "params": {"ops": ["+"]}},
        "rollout": {"num_return_sequences": 4, "max_new_tokens": 4, "num_rollout_workers": 1},
        "trainer": {"rollout_batch_size": 4, "total_steps": STEPS, "async_ratio": 1},
        "eval": {"every": 1, "size": EVAL_SIZE},
    }
    command = (
        f"{shlex.quote(sys.executable)} -m rollflash.rollctl.cli run "
        f"--config <(printf %s {shlex.quote(yaml.safe_dump(config))})"
    )
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = [p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))]
    for text in [out.stdout, out.stderr, *logs]:
        assert "Loading weights" not in text and "Loading checkpoint shards" not in text
        assert "it/s]" not in text  # no tqdm bar of any kind
    rows = [json.loads(x) for x in (run_dir / "eval_generations.jsonl").read_text().splitlines()]
    greedy = [(r["step"], r["eval"]) for r in rows if r["eval"] == "greedy"]
    # before training, after step 1, after step 2 (the final one: not a second time)
    assert sorted(greedy) == sorted([(s, "greedy") for s in (0, 1, 2) for _ in range(EVAL_SIZE)])

    exported = tmp_path / "exported"
    res = _rollctl("export", "--run-dir", str(run_dir), "--out", str(exported))
    assert res.returncode == 0, res.stderr
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()

    status = _rollctl("status", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "None" not in status.stdout
    assert "state=done" in status.stdout
    for line in status.stdout.splitlines():
        if " lag=" in line and "lag=0" not in line:  # left over when the run ended
            assert "for steps the run did not take; a longer or resumed run uses them" in line
