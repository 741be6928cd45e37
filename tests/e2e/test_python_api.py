"""`from rollflash import Run` as a notebook uses it, in a Python process of its own (the
notebook's kernel): rows in memory (a list of dicts and a `datasets.Dataset`), reward functions
as Python callables (one counts its calls in this process, one abstains with None on every
sample), a callback that receives every step, `stop()` mid-run from the step iterator,
`train()` again to the end, and `export()` / `model()` of the trained weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from harness import trained_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS, B, N = 8, 4, 4

NOTEBOOK = """
import json, random, sys, threading, time
import datasets
from rollflash import Run

rng = random.Random(0)
rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "kind": "sum"}
        for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(120))]
calls, seen = [], []
hold = threading.Event()  # set while stop() runs: no sample is scored meanwhile

def quarter(prompt, response, answer, **row):
    calls.append(prompt)
    waited = time.monotonic()
    while hold.is_set() and time.monotonic() - waited < 60:
        time.sleep(0.05)
    return 0.25

def prose_only(prompt, response, answer, kind="", **row):
    return None if kind != "prose" else 1.0  # no prose rows here: it abstains on every sample

run = Run(
    sys.argv[1],
    model={"path": sys.argv[2]},
    run={"run_dir": sys.argv[3]},
    dataset=rows[:100],
    eval_dataset=datasets.Dataset.from_list(rows[100:]),
    trainer={"total_steps": int(sys.argv[4]), "rollout_batch_size": int(sys.argv[5]),
             "checkpoint_every": 1},
    rollout={"num_return_sequences": int(sys.argv[6])},
    eval={"size": 4},
    reward={"functions": [quarter, prose_only]},
    callbacks=[lambda row: seen.append(row["step"])],
    echo=False,
)
for row in run.steps():  # starts the run
    if row["step"] >= 2:
        # the learner trains on only what is scored: with scoring held it can pass at most the
        # groups admission let out (async_ratio 1: two steps beyond its own), so it stops mid-run
        hold.set()
        code = run.stop()
        hold.clear()
        break
stopped = run.status()
result = run.train()  # resumes from the last checkpoint
path = run.export()
model = run.model()
print(json.dumps({
    "code": code, "stopped": stopped, "seen": seen, "calls": len(calls),
    "summary": result.summary, "status": run.status()["state"], "export": str(path),
    "params": sum(p.numel() for p in model.parameters()), "metrics": run.metrics,
}))
"""


def test_a_notebook_trains_from_rows_in_memory_stops_resumes_and_exports(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    demo = ROOT / "configs" / "demo.yaml"
    out = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, str(demo), str(tiny_model_dir), str(run_dir)]
        + [str(STEPS), str(B), str(N)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # stop(): rollctl run ended as Ctrl-C ends it (130), after at least 2 steps, before the end
    assert result["code"] == 130
    stopped = result["stopped"]
    assert stopped["state"] == "stopped" and 2 <= stopped["step"] < STEPS, stopped
    # train() again resumed the run to its end: every step trained once
    assert result["status"] == "done" and result["summary"]["steps"] == STEPS
    assert len(trained_ids(run_dir)) == len(set(trained_ids(run_dir))) == STEPS * B
    # the callback saw every step: those of the first start, then the resumed ones
    assert set(result["seen"]) == set(range(1, STEPS + 1)), result["seen"]
    assert result["seen"][-1] == STEPS
    metrics = result["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # the rows came from memory, through the run directory: the task read them there
    assert (run_dir / "data" / "train.jsonl").read_text().count("\n") == 100
    assert (run_dir / "data" / "eval.jsonl").read_text().count("\n") == 20
    run_yaml = (run_dir / "run.yaml").read_text()
    assert str(run_dir / "data" / "train.jsonl") in run_yaml and "name: dataset" in run_yaml
    # the reward is `quarter`'s alone: prose_only abstained on every sample (B x N = 16 a step)
    # and was counted, never fatal; `quarter` ran in the notebook's process, for at least
    # the 4 steps x 16 samples trained
    assert all(m["reward/mean"] == 0.25 for m in metrics), metrics
    assert all(m["reward/abstained/prose_only"] == B * N for m in metrics), metrics
    assert result["calls"] >= STEPS * B * N
    # warned at start, in one line: a right answer scores 0.25 (quarter; prose_only abstains),
    # below eval.threshold 1.0, so held-out accuracy can count no response right
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("learner.log*"))
    assert "eval.threshold: 1 is above what a right answer scores" in logs
    assert "score at most 0.25" in logs
    # learning health rides along: every step's share of groups that all answer alike
    assert all(0 <= m["health/same_answer_frac"] <= 1 for m in metrics)
    assert "heldout_top_answer_share_after" in result["summary"]
    # the trained model back: the last version, as a transformers model directory
    exported = Path(result["export"])
    assert exported.parent == run_dir / "export" and (exported / "config.json").is_file()
    assert result["params"] > 0
