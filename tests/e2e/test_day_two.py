"""Day two as a person runs it: `make demo`'s command (configs/demo.yaml, shortened to a tiny model
and a few steps), then the commands that read the run (docs/running.md, "Day two"), from the
directory `make demo` runs in; then the run extended by running it again with a larger
`trainer.total_steps`. tests/e2e/test_readme.py runs the README's own blocks as written."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def day_two_commands() -> list[list[str]]:
    """The `rollctl` lines of docs/running.md's block that follows "After `make demo`:"."""
    text = (ROOT / "docs" / "running.md").read_text()
    block = text.split("After `make demo`:", 1)[1].split("\n\n", 2)[1]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("rollctl ")]


def _rollctl(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="replace",  # XRANGE prints the binary msgpack `data` field as it is
        timeout=timeout,
    )


def _demo(tmp_path: Path, model: Path, steps: int) -> subprocess.CompletedProcess:
    """`make demo`'s `rollctl run --config configs/demo.yaml`, shortened."""
    sets = [
        f"model.path={model}",
        f"trainer.total_steps={steps}",
        "trainer.rollout_batch_size=4",
        "rollout.num_return_sequences=4",
        "eval.size=8",
    ]
    args = ["run", "--config", str(ROOT / "configs" / "demo.yaml")]
    return _rollctl(args + [a for s in sets for a in ("--set", s)], tmp_path, timeout=400)


def test_day_two_after_make_demo_then_extend_the_run(tmp_path, tiny_model_dir):
    first = _demo(tmp_path, tiny_model_dir, steps=3)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    assert first.stdout.startswith("layout: ")  # the CPU layout, printed at start
    assert "step 1/3" in first.stdout
    run_dir = tmp_path / "runs" / "demo"

    commands = day_two_commands()
    assert [c[:2] for c in commands] == [
        ["rollctl", "status"],
        ["rollctl", "inspect"],
        ["rollctl", "inspect"],
        ["rollctl", "redis-cli"],
        ["rollctl", "redis-cli"],
    ]
    outputs = []
    for command in commands:  # the run has ended: they read the snapshot its Redis left
        out = _rollctl(command[1:], tmp_path)
        assert out.returncode == 0, (command, out.stderr[-2000:])
        outputs.append(out.stdout)
    status, last_two, prompt, groups, entry = outputs
    assert "run demo: state=done step=3" in status
    assert "weights: v3" in status
    # two trajectory entries, each a prompt of the demo's task and its 4 decoded samples
    heads = [line for line in last_two.splitlines() if line.startswith("trajectories ")]
    assert len(heads) == 2, last_two
    assert len(re.findall(r"prompt: '\d+\+\d+='", last_two)) == 2, last_two
    assert len(re.findall(r"^  \[\d\] reward ", last_two, re.M)) == 2 * 4, last_two
    assert re.search(r"prompt: '\d+\+\d+='", prompt), prompt
    assert "learner" in groups.split() and "lag" in groups.split()
    assert "traj_id" in entry.split() and "reward_mean" in entry.split()

    as_json = _rollctl(["inspect", "--last", "2", "--json"], tmp_path)
    views = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [len(v["samples"]) for v in views] == [4, 4]
    for v in views:
        assert 0 <= v["behavior_version"] <= 3 and v["staleness"] == 3 - v["behavior_version"]
        assert all(s["tokens"] >= 1 and s["versions"][0] <= s["versions"][1] for s in v["samples"])

    # extend: the same command with a larger total_steps resumes from the step-3 checkpoint
    second = _demo(tmp_path, tiny_model_dir, steps=5)
    assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_process"]) == (5, 2)
    # its output is its own learner's log: none of the first process's lines come back
    assert "step 1/3" not in second.stdout and "step 4/5" in second.stdout
    assert "step 1/3" in (run_dir / "logs" / "learner.log.1").read_text()
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
    after = _rollctl(["status", "demo"], tmp_path)
    assert "state=done step=5" in after.stdout, after.stderr
