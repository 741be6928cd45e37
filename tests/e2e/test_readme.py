"""The README, followed top to bottom: every fenced block whose info string is `bash runnable`
or `python runnable` runs, in the README's order, in one bash session (`set -euo pipefail`, so a
failing command fails its block; a Python block is given to `python -` there, after the bash
blocks before it activated the .venv) in a fresh directory laid out like a checkout. What the
blocks promise is checked from what they leave behind: the demo's summary and report, the
own-data run's summary, the Python API's run and export, the status of the extended run.

The directory links the checkout's tracked files and its `.venv` (a user's `make demo` builds
both), and `models/tiny` is the shared cache's demo model (tests/conftest.py `warm_model_dir`, the
Makefile's TINY_MODEL_ARGS), so `make demo` trains instead of rebuilding it; `-o .venv/.installed`
keeps make from reinstalling the package from the temporary directory. Everything the blocks
write (runs/, data/, my_run.yaml) stays in that directory."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(bash|python) runnable\n(.*?)^```$", re.M | re.S)
PYTHON_END = "README_PYTHON_BLOCK_END"  # the here-document's delimiter


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, bash) of every `bash runnable` or `python runnable`
    block; a Python block becomes a `python -` here-document."""
    out = []
    for m in FENCE.finditer(text):
        body = m.group(2)
        if m.group(1) == "python":
            body = f"python - <<'{PYTHON_END}'\n{body}{PYTHON_END}\n"
        out.append((text.count("\n", 0, m.start()) + 1, body))
    return out


def test_runnable_blocks_are_found():
    text = (
        "a\n```bash runnable\necho 1\n```\n```bash\nnot this\n```\n```bash runnable\nx\ny\n```\n"
        "```python runnable\nprint(1)\n```\n```python\nnot this\n```\n"
    )
    # the first fence is line 2, the third opens line 8, the python block line 12
    assert runnable_blocks(text) == [
        (2, "echo 1\n"),
        (8, "x\ny\n"),
        (12, f"python - <<'{PYTHON_END}'\nprint(1)\n{PYTHON_END}\n"),
    ]
    script = runnable_blocks(text)[2][1]
    out = subprocess.run(["bash", "-c", script.replace("python", sys.executable, 1)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout == "1\n"


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
    # the demo, own data on CPU, from Python, the GPU dry run, day-two commands, resume
    assert len(blocks) >= 6, blocks
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
    assert mine["health_warnings"] == []  # it learns: no learning-health warning
    # the Python API's block: its run, each step printed by its callback, its export
    notebook = json.loads((work / "runs" / "notebook" / "summary.json").read_text())
    assert notebook["steps"] == 10 and notebook["heldout_acc_after"] > 0
    assert all(f"step {k}: reward " in text for k in range(1, 11))
    assert (work / "runs" / "notebook" / "export" / "v00000010" / "config.json").is_file()
    # the printed results: the demo's summary line, the dry run's layout, status, config show
    assert '"heldout_acc_after"' in text
    assert "layout: GPUs 0,1,2,3,4,5,6,7: the learner 0,1,2,3, 4 generator(s)" in text
    assert "run demo: state=done" in text
    assert "rollout_batch_size: 32" in text  # config show: a key the demo sets
    assert re.search(r"^152$", text, re.M)  # status --json after the extension
