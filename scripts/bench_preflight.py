"""How long `rollctl run` takes to refuse a mistake found before anything starts
(rollctl/preflight.py): prints one JSON line with each case's seconds, from the command's start to
its exit (the whole process: Python, imports, the config, the checks), the median of --repeat.

The project is the README's own-data example (a JSONL train and test file, a reward function of
the user's, the demo's model); each case changes one key (`CASES`). tests/e2e/test_preflight.py
runs the same cases for their lines; this script only times them.

    python scripts/bench_preflight.py --model models/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# case -> (the --set that makes the mistake, how its one line starts)
CASES: dict[str, tuple[str, str]] = {
    "missing model": (
        "model.path=models/none",
        "rollctl: error: model.path: no model directory at models/none",
    ),
    "missing data file": (
        "task.params.path=data/missing.jsonl",
        "rollctl: error: task.params.path: no such file or directory: data/missing.jsonl",
    ),
    "empty JSONL": (
        "task.params.path=data/empty.jsonl",
        "rollctl: error: task.params.path: data/empty.jsonl is empty, no rows",
    ),
    "bad import string": (
        "reward.functions=[exact, 'my_rewards:nope']",
        "rollctl: error: reward.functions[1]: cannot import my_rewards:nope (AttributeError: ",
    ),
    "nothere.jsonl": (
        "task.params.path=nothere.jsonl",
        "rollctl: error: task.params.path: no such file or directory: nothere.jsonl",
    ),
}


def write_project(root: Path, model: Path) -> Path:
    """The README's own-data example under `root`; returns its config."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2000), ("test", 100)):
        rows = [{"question": f"{10 + i % 90}+{10 + i // 90 % 90}=",
                 "answer": str(20 + i % 90 + i // 90 % 90)} for i in range(n)]  # fmt: skip
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "empty.jsonl").write_text("")
    (root / "my_rewards.py").write_text(
        "def digits_only(prompt, response, answer, **row):\n"
        "    return 1.0 if response.strip().isdigit() else 0.0\n"
    )
    config = root / "my_run.yaml"
    config.write_text(
        "run: {run_id: mine, run_dir: runs/mine}\n"
        f"model: {{path: {model}}}\n"
        "task:\n  name: dataset\n"
        "  params: {path: data/train.jsonl, eval_path: data/test.jsonl, prompt_key: question,\n"
        "           answer_key: answer}\n"
        'reward: {functions: [exact, "my_rewards:digits_only"], weights: [1.0, 0.1]}\n'
        "rollout: {num_return_sequences: 8, max_new_tokens: 4}\n"
        "trainer: {rollout_batch_size: 16, total_steps: 10}\n"
        "eval: {size: 100}\n"
    )
    return config


def run_case(root: Path, config: Path, mistake: str) -> tuple[subprocess.CompletedProcess, float]:
    """`rollctl run --config CONFIG --set MISTAKE` in `root`; the result and its seconds."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLASH_PREFLIGHT_DONE"}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(config)]
        + ["--set", mistake],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny", help="a model directory")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    config = write_project(root, Path(args.model).resolve())
    seconds, ok = {}, True
    for name, (mistake, line) in CASES.items():
        times = []
        for _ in range(args.repeat):
            out, took = run_case(root, config, mistake)
            ok = ok and out.returncode == 2 and out.stderr.startswith(line)
            ok = ok and len(out.stderr.splitlines()) == 1 and not (root / "runs").exists()
            times.append(took)
        seconds[name] = round(statistics.median(times), 2)
    passing = [_checks_passing(root, config) for _ in range(args.repeat)]
    print(json.dumps({"bench": "preflight", "cpus": os.cpu_count(),
                      "machine": platform.machine(), "seconds": seconds,
                      "checks_of_the_correct_project_s": round(statistics.median(passing), 2),
                      "one_line_each_nothing_started": ok}))  # fmt: skip


def _checks_passing(root: Path, config: Path) -> float:
    """Seconds the checks of the correct project add to a start (in a fresh process, after its
    imports: what `rollctl run` pays before it starts Redis)."""
    code = (
        "import sys, time; from rollflash.broker.config.config import load_config; "
        "from rollflash.rollctl.preflight import preflight; cfg = load_config(sys.argv[1]); "
        "t = time.perf_counter(); preflight(cfg, ('learner', 'generator'), {}); "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(config)], cwd=root, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return float(out.stdout)


if __name__ == "__main__":
    main()
