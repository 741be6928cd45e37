"""`rollctl plot` on a short real run (`rollctl run`: redis-server, a learner, a generator, the tiny
model): the report is a PNG with every panel drawn, and `--compare` overlays a second run."""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e .[plot]")


def _rollctl(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_plot_renders_a_report_from_a_short_run(tmp_path, tiny_model_dir, redis_url, run_id):
    from PIL import Image

    from rollflash.rollctl.plot import render

    run_dir = tmp_path / "run"
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(run_dir), "torch_threads": 1},
        "model": {"path": str(tiny_model_dir)},
        "task": {"name": "arithmetic"},
        "eval": {"size": 8, "every": 2},
        "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
        "trainer": {"rollout_batch_size": 2, "total_steps": 4},
        "logging": {"completions_per_step": 3},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = _rollctl("run", "--config", str(path), "--generators", "1", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr[-3000:]

    # 3 completions per step: best, worst, random, each with its prompt and reward
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert [r["pick"] for r in rows[:3]] == ["best", "worst", "random"]
    assert rows[0]["reward"] >= rows[2]["reward"] >= rows[1]["reward"]
    assert all(r["prompt"] and r["staleness"] >= 0 for r in rows)
    # greedy evaluation of the 8 held-out items before training and at steps 2 and 4
    # (eval.every); the final version is the step-4 one, evaluated once: each generation with its
    # reward and verdict
    evals = [json.loads(x) for x in (run_dir / "eval_generations.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in evals) == {0: 8, 2: 8, 4: 8}
    assert all(r["eval"] == "greedy" and r["pass"] == (r["reward"] >= 1.0) for r in evals)

    out = _rollctl("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"report: {run_dir / 'report.png'}"
    with Image.open(run_dir / "report.png") as im:
        assert im.format == "PNG" and im.size == (1200, 880)

    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("weights", "checkpoints"))
    report = render([run_dir, other], tmp_path / "compare.png")
    assert Path(report.path).stat().st_size > 10_000
    assert report.empty_panels == []  # the real learner logs something for every panel
    # its length metrics (the stale mean only in steps that drop a group as stale)
    drawn = set(report.legends["length"])
    assert {f"{run_dir.name} length/{fate}_mean" for fate in ("trained", "completed")} <= drawn
