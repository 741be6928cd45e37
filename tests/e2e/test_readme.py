"""The README, followed top to bottom: every fenced block whose info string is `bash runnable`
runs, in the README's order, in one bash session (`set -euo pipefail`, so a failing command fails
its block) in a fresh directory laid out like a checkout. What the blocks promise is checked from
what they leave behind: the demo's summary and report, the own-data run's summary, the status of
the extended run.

The directory links the checkout's tracked files and its `.venv` (a user's `make demo` builds
both), and `models/tiny` is the shared cache's demo model (tests/conftest.py `warm_model_dir`, the
Makefile's TINY_MODEL_ARGS), so `make demo` trains instead of rebuilding it; `-o .venv/.installed`
keeps make from reinstalling the package from the temporary directory. Everything the blocks
write (runs/, data/, my_run.yaml) stays in that directory."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```bash runnable\n(.*?)^```$", re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, body) of every `bash runnable` block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_runnable_blocks_are_found():
    text = "a\n```bash runnable\necho 1\n```\n```bash\nnot this\n```\n```bash runnable\nx\ny\n```\n"
    # the first fence is line 2, the third opens line 8
    assert runnable_blocks(text) == [(2, "echo 1\n"), (8, "x\ny\n")]


def checkout_copy(dest: Path) -> None:
    """Link the checkout's tracked top-level entries and .venv into `dest`."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in sorted({p.split("/")[0] for p in tracked} | {".venv"}):
        (dest / name).symlink_to(ROOT / name)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the demo's 150 steps, then the other blocks: 4-10 min
def test_readme_runs_top_to_bottom(tmp_path, warm_model_dir):
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    # the demo, own data on CPU, the GPU dry run, day-two commands, resume
    assert len(blocks) >= 5, blocks
    work = tmp_path / "checkout"
    work.mkdir()
    checkout_copy(work)
    (work / "models").mkdir()
    (work / "models" / "tiny").symlink_to(warm_model_dir)
    script = ["set -euo pipefail"]
    for line, body in blocks:
        script += [f"echo '@@ README.md:{line}' >&2", body]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["MAKEFLAGS"] = "-o .venv/.installed"
    log = tmp_path / "readme.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1500,
        )
    text = log.read_text()
    started = re.findall(r"^@@ (README\.md:\d+)$", text, re.M)
    assert proc.returncode == 0, f"block {started[-1] if started else '?'} failed:\n{text[-4000:]}"
    assert len(started) == len(blocks)

    demo = json.loads((work / "runs" / "demo" / "summary.json").read_text())
    # the resume block extended the demo's 150 steps to 152
    assert demo["steps"] == 152
    assert (work / "runs" / "demo" / "report.png").stat().st_size > 0
    mine = json.loads((work / "runs" / "mine" / "summary.json").read_text())
    assert mine["steps"] == 10 and 0 <= mine["heldout_acc_after"] <= 1
    # the printed results: the demo's summary line, the dry run's layout, status, config show
    assert '"heldout_acc_after"' in text
    assert "layout: GPUs 0,1,2,3,4,5,6,7: the learner 0,1,2,3, 4 generator(s)" in text
    assert "run demo: state=done" in text
    assert "rollout_batch_size: 32" in text  # config show: a key the demo sets
    assert re.search(r"^152$", text, re.M)  # status --json after the extension
