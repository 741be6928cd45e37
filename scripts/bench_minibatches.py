"""Benchmark: PPO mini-batches on the demo, M = 1 against M = 4 (`trainer.ppo_mini_batches`).

Runs `rollctl run --config configs/demo.yaml` (the real system: an embedded redis-server, the
learner and the generators `rollctl run` lays out on this machine's cores) once per M and seed,
interleaved (seed 0 M=1, seed 0 M=4, seed 1 M=1, ...) so that a host that drifts moves both alike.
With `--scale-lr` each M runs at `trainer.actor_lr` / M, so that a step moves the policy about as
far as one update does (AdamW's step is about the learning rate whatever the gradient's size).
First, in this process, one recorded demo batch is trained on at each M in interleaved rounds
(`train_step` alone, one thread): its median seconds and the ratio to M = 1 are the cost of the
proximal pass and the extra updates without the rest of the system. Then, per run of the system,
it records the held-out greedy accuracy before and after (`summary.json`), the median
learner step (`perf/step_s`) and its train part (`perf/train_s`) over steps 2.., and the mean
`policy/clip_frac` and `policy/approx_kl`. Prints one JSON line: per M the runs, the mean
accuracy after training, and the ratio of M's median step to M = 1's, measured in the same run.

    .venv/bin/python scripts/bench_minibatches.py [--mini-batches 1,4] [--seeds 0,1,2]
                                                  [--scale-lr] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.broker.config.config import load_config  # noqa: E402


def one_run(m: int, seed: int, sets: list[str], root: Path, lr: float | None) -> dict:
    run_dir = root / f"m{m}-s{seed}"
    overrides = [
        *sets,
        f"run.run_dir={run_dir}",
        f"run.run_id=bench-m{m}-s{seed}",
        f"run.seed={seed}",
        f"trainer.ppo_mini_batches={m}",
        *([f"trainer.actor_lr={lr}"] if lr is not None else []),  # after --set: it scales it
    ]
    cmd = [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config"]
    cmd += [str(ROOT / "configs" / "demo.yaml")] + [a for o in overrides for a in ("--set", o)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return {
        "seed": seed,
        "heldout_acc_before": summary["heldout_acc_before"],
        "heldout_acc_after": summary["heldout_acc_after"],
        "step_s_median": round(statistics.median(r["perf/step_s"] for r in rows), 4),
        "train_s_median": round(statistics.median(r["perf/train_s"] for r in rows), 4),
        "clip_frac_mean": round(statistics.mean(r["policy/clip_frac"] for r in rows), 4),
        "approx_kl_mean": round(statistics.mean(r["policy/approx_kl"] for r in rows), 6),
        "wall_s": summary["wall_s_this_process"],
    }


def train_step_seconds(ms: list[int], rounds: int = 10) -> dict[int, float]:
    """Median seconds of `train_step` on one recorded demo batch at each M, interleaved."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_pipeline import HFEngine, record_step

    from rollflash.learner.models.policy import load_policy
    from rollflash.learner.process.device import adamw
    from rollflash.learner.step.prepare import AlgoModels
    from rollflash.learner.step.train import train_step

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["run.torch_threads=1"])
    groups, _ = record_step(cfg, HFEngine(cfg.model.path))
    runs = {}
    for m in ms:
        c = cfg.model_copy(deep=True)
        c.trainer.ppo_mini_batches = m
        model, _ = load_policy(c)
        runs[m] = (c, model, adamw(model.parameters(), c.trainer.actor_lr, 0.0))
    times: dict[int, list[float]] = {m: [] for m in ms}
    for i in range(rounds + 1):
        for m, (c, model, opt) in runs.items():
            started = time.perf_counter()
            train_step(model, opt, groups, c, AlgoModels())
            if i:  # the first round warms up
                times[m].append(time.perf_counter() - started)
    return {m: statistics.median(t) for m, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mini-batches", default="1,4")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--scale-lr", action="store_true", help="actor_lr / M for each M")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    ms = [int(x) for x in args.mini_batches.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    runs: dict[int, list[dict]] = {m: [] for m in ms}
    base_lr = load_config(ROOT / "configs" / "demo.yaml", args.sets).trainer.actor_lr
    alone = train_step_seconds(ms)
    with tempfile.TemporaryDirectory(prefix="bench-minibatches-") as tmp:
        for seed in seeds:
            for m in ms:
                lr = base_lr / m if args.scale_lr else None
                runs[m].append(one_run(m, seed, args.sets, Path(tmp), lr))
    base = statistics.median(r["step_s_median"] for r in runs[ms[0]])
    out = {
        "benchmark": "minibatches",
        "config": "configs/demo.yaml",
        "scale_lr": args.scale_lr,
        "by_m": {
            str(m): {
                "heldout_acc_after_mean": round(
                    statistics.mean(r["heldout_acc_after"] for r in rs), 4
                ),
                "step_s_ratio": round(statistics.median(r["step_s_median"] for r in rs) / base, 3),
                "train_step_s": round(alone[m], 4),
                "train_step_ratio": round(alone[m] / alone[ms[0]], 3),
                "runs": rs,
            }
            for m, rs in runs.items()
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
