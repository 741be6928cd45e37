"""Benchmark: wall time of the same workload at async ratios 0, 0.5, 1 and 2.

Runs the real system — an embedded redis-server, the real learner control loop (admission,
collection, staleness filter, publishing) and 4 generator processes — with the simulated engine
(`rollout.engine: sim`: GPU-like decode timing with a long-tail length distribution) and a
simulated learner step, so the result measures scheduling, not this machine's CPU.

The default workload (WORKLOAD): 32 prompts x 8 samples per learner step (1.0 s simulated), 4
generators doing continuous batching (up to 32 samples each in flight, `rollout.inflight_samples`)
with in-flight weight updates (`rollout.interrupt`), log-normal response lengths (median 48
tokens, sigma 1.2, cap 1024). `--pulls` is the earlier workload (PULLS): one prompt of 4 samples
per pull, no interrupt, 16 prompts per 1.6 s step.

Prints one JSON line: per ratio the wall time of steps 2..K (step 1 includes start-up), the
speedup over a = 0, the mean generator idle fraction (nothing in flight) and mean batch
(samples in flight while decoding), groups restarted as too stale, the learner's wait fraction,
the largest staleness seen and the groups the learner dropped as stale; and, over every step, the
length bias of the staleness bound (`length_bias`): the groups it cost (dropped by the learner or
restarted by a generator) per group generated (`stale_frac`), the overdue groups trained
(learner/intake/ready.py), and the mean response length of the trained samples against that of every
completed sample (`trained_vs_completed_len`, 1.0 without bias; learner/metrics/lengths.py).

    .venv/bin/python scripts/bench_async.py [--steps 12] [--ratios 0,0.5,1,2] [--pulls]
                                            [--set key=value ...]

`--multi-turn` swaps the single-turn task for the simulated multi-turn environment
(envs/simulated.py, `MULTI_TURN`): episodes of 2-6 turns whose environment steps take log-normal
time (median 0.1 s), each turn a simulated generation, run by the episode runner
(generators/episodes.py) with no barrier between the episodes of a pull.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.broker.channels.registry import RunRegistry  # noqa: E402
from rollflash.broker.config.config import load_config  # noqa: E402
from rollflash.broker.connect.connection import connect  # noqa: E402
from rollflash.broker.connect.redis_io import RunRedis  # noqa: E402
from rollflash.broker.connect.redis_server import EmbeddedRedis  # noqa: E402
from rollflash.rollctl.local import run_local  # noqa: E402

WORKLOAD = [
    "rollout.engine=sim",
    "rollout.num_return_sequences=8",
    "rollout.max_new_tokens=1024",
    "rollout.inflight_samples=32",
    "rollout.interrupt=true",
    "rollout.num_rollout_workers=4",
    "trainer.rollout_batch_size=32",
    "trainer.wait_timeout_s=120",
    "sim.per_token_s=0.002",
    "sim.length_median=48",
    "sim.length_sigma=1.2",
    "sim.learner_step_s=1.0",
    "eval.size=1",
    "run.torch_threads=1",
]

# the workload of the first table in docs/BENCHMARKS.md: pulls of one prompt, no interrupt
PULLS = [
    "rollout.inflight_samples=0",
    "rollout.interrupt=false",
    "rollout.prompts_per_pull=1",
    "rollout.num_return_sequences=4",
    "trainer.rollout_batch_size=16",
    "sim.learner_step_s=1.6",
]

MULTI_TURN = PULLS + [
    "task.name=sim_env",
    "task.params={min_turns: 2, max_turns: 6, step_latency_s: 0.1, latency_sigma: 1.0}",
    "rollout.max_new_tokens=256",
    "rollout.max_episode_tokens=4096",
    "sim.length_median=24",
    "rollout.prompts_per_pull=4",  # 16 concurrent episodes per generator
]


def run_one(ratio: float, steps: int, overrides: list[str], workdir: Path) -> dict:
    run_dir = workdir / f"a{ratio}"
    with EmbeddedRedis() as server:
        cfg = load_config(
            None,
            WORKLOAD
            + overrides
            + [
                f"trainer.async_ratio={ratio}",
                f"trainer.total_steps={steps}",
                f"run.run_id=bench-a{ratio}",
                f"run.run_dir={run_dir}",
                f"redis.url={server.url}",
            ],
        )
        if run_local(cfg, echo=False) != 0:
            raise SystemExit(f"run with async_ratio={ratio} failed; see {run_dir}/logs")
        registry = RunRegistry(RunRedis(connect(server.url, 5), cfg.run.run_id))
        gens = list(registry.live_generators().values())
        idle = [float(g["idle_frac"]) for g in gens]
        batch = [float(g.get("mean_batch", 0)) for g in gens]
        tokens_per_busy_s = [int(g["tokens"]) / float(g["busy_s"]) for g in gens]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restarted = sum(int(g.get("restarted", 0)) for g in gens)
    return {
        **length_bias(metrics, cfg.rollout.num_return_sequences, restarted),
        "wall_s": round(sum(m["perf/step_s"] for m in metrics[1:]), 2),
        "gen_idle_frac": round(sum(idle) / len(idle), 3),
        "gen_mean_batch": round(sum(batch) / len(batch), 1),
        "gen_tokens_per_busy_s": round(sum(tokens_per_busy_s) / len(gens)),
        "gen_restarted": restarted,
        "learner_wait_frac": round(
            sum(m["perf/wait_frac"] for m in metrics[1:]) / (len(metrics) - 1), 3
        ),
        "staleness_max": max(m["async/staleness_max"] for m in metrics),
        "dropped_stale": sum(m["async/dropped_stale"] for m in metrics),
    }


def length_bias(metrics: list[dict], n: int, restarted: int) -> dict:
    """Over every step of a run: the groups lost to the staleness bound (dropped by the learner,
    or started again by a generator) per group generated (completed, or started again), and the
    mean response length of the trained samples against that of every completed sample
    (learner/metrics/lengths.py)."""

    def weighted(fate: str) -> tuple[float | None, int]:
        rows = [m for m in metrics if m[f"length/{fate}_samples"]]
        samples = sum(m[f"length/{fate}_samples"] for m in rows)
        tokens = sum(m[f"length/{fate}_mean"] * m[f"length/{fate}_samples"] for m in rows)
        return (round(tokens / samples, 1) if samples else None), samples

    trained = sum(m["length/trained_mean"] for m in metrics) / len(metrics)  # B x n samples each
    completed, completed_samples = weighted("completed")
    dropped = sum(m["async/dropped_stale"] for m in metrics)
    generated = completed_samples // n + restarted
    return {
        "groups_generated": generated,
        "stale_frac": round((dropped + restarted) / max(generated, 1), 4),
        "overdue_trained": sum(m["async/overdue"] for m in metrics),
        "trained_len": round(trained, 1),
        "completed_len": completed,
        "stale_len": weighted("stale")[0],
        "trained_vs_completed_len": round(trained / (completed or trained), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ratios", default="0,0.5,1,2")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--multi-turn", action="store_true", help="the multi-turn workload (MULTI_TURN)")
    p.add_argument(
        "--pulls",
        action="store_true",
        help="one prompt per pull instead of continuous batching (PULLS)",
    )
    args = p.parse_args()
    if args.multi_turn:
        args.overrides = MULTI_TURN + args.overrides
    elif args.pulls:
        args.overrides = PULLS + args.overrides
    ratios = [float(r) for r in args.ratios.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        results = {r: run_one(r, args.steps, args.overrides, Path(tmp)) for r in ratios}
    base = results[ratios[0]]["wall_s"]
    print(
        json.dumps(
            {
                "bench": "async",
                "steps_timed": args.steps - 1,
                "workload": WORKLOAD + args.overrides,
                "results": {
                    str(r): {**v, "speedup": round(base / v["wall_s"], 2)}
                    for r, v in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
