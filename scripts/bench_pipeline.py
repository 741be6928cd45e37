"""Benchmark: how close the whole system runs to its ideal pipeline, and where a learner step goes.

On the demo model and task (configs/demo.yaml, models/tiny) it measures in one run:
  (a) the bare learner loop on a recorded batch: forward, log-prob gather, backward, AdamW step
      on the same micro-batches `train_step` builds (prepared once, outside the timing), with
      the learner's own optimiser (fused AdamW);
  (b) the project's `train_step` (learner/step/train.py) on the same batch;
  (c) bare generation of one step's B x n samples with the HF engine, in pulls of
      `rollout.prompts_per_pull` prompts as a generator makes them;
  (d) the whole `rollctl run` (embedded Redis, learner, generators) at async ratio 0 and 1, in
      samples/s between the learner's second and last step, with the learner's median step and
      train_step in that run and their difference: what the learner does besides training,
      measured in the same minutes (the host's speed drifts from one run to the next);
and reports b/a (the learner's overhead), d against the ideal pipeline B*n / max(a, c) (one core
trains while another generates: what an asynchronous system can reach at best with one process
per core), and a per-phase breakdown of one learner step, measured on an in-process learner
whose trajectories are the recorded batch replayed through Redis (no generation competes with
it): collect (Redis read, decode, issuing prompts), batch building, forward/backward, metrics,
publish, checkpoint, acknowledge. (a), (b) and (c) run with one torch thread, alternately, and
report medians. The host's speed drifts by 10% and more within minutes here, so (a) and (c) are
measured again after the whole-system runs and the ideal uses the medians of both rounds: it
spans the same minutes as (d). `--flame` adds a py-spy profile of the in-process learner, summarised as the
functions with the most samples (inclusive and self), when py-spy is installed.

    .venv/bin/python scripts/bench_pipeline.py [--model models/tiny] [--steps 20] [--repeats 7]
                                               [--flame] [--set key=value ...]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollflash.broker.config.config import Config, load_config  # noqa: E402
from rollflash.broker.connect.redis_server import EmbeddedRedis  # noqa: E402
from rollflash.broker.wire.schema import (  # noqa: E402
    PromptWork,
    Trajectory,
    decode_trajectory,
    encode_trajectory,
)
from rollflash.broker.wire.wire import WireLimits  # noqa: E402
from rollflash.envs import task_from_config  # noqa: E402
from rollflash.generators.hf_engine import HFEngine  # noqa: E402
from rollflash.generators.rollout import to_trajectory  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402
from rollflash.learner.models.policy import load_policy  # noqa: E402
from rollflash.learner.process.device import adamw  # noqa: E402
from rollflash.learner.step.prepare import AlgoModels, prepare_batch  # noqa: E402
from rollflash.learner.step.step_spec import StepSpec  # noqa: E402
from rollflash.learner.step.train import train_step  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_phases import learner_phases  # noqa: E402


def bench_config(model: str, overrides: list[str], run_dir: str) -> Config:
    sets = [f"model.path={model}", f"run.run_dir={run_dir}", "eval.size=8", *overrides]
    return load_config(ROOT / "configs" / "demo.yaml", sets)


def record_step(cfg: Config, engine: HFEngine) -> tuple[list[Trajectory], float]:
    """One step's B groups of n samples, generated in pulls as a generator does, scored, and
    passed through the wire (encode, bounded decode) as the learner receives them; returns them
    with the seconds the generation took."""
    task, r, b = task_from_config(cfg), cfg.rollout, cfg.trainer.rollout_batch_size
    items = [it for _, it in zip(range(b), task.train_items(cfg.run.seed))]
    params = SamplingParams.for_rollout(r, r.num_return_sequences)
    started, samples = time.perf_counter(), []
    for i in range(0, b, r.prompts_per_pull):
        samples += engine.generate([it.prompt for it in items[i : i + r.prompts_per_pull]], params)
    gen_s = time.perf_counter() - started
    limits = WireLimits.for_config(cfg, engine.vocab_size)
    groups = []
    for k, (item, group) in enumerate(zip(items, samples)):
        work = PromptWork(item.id, f"g{k}", r.num_return_sequences, 0, item.__dict__)
        traj = to_trajectory(work, group, task, "bench", 0)
        fields = {key.encode(): _wire(v) for key, v in encode_trajectory(traj).items()}
        groups.append(decode_trajectory(fields, limits))
    return groups, gen_s


def _wire(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def generation_time(cfg: Config, engine: HFEngine) -> float:
    return record_step(cfg, engine)[1]


def bare_step(model, optimizer, micro, temperature: float) -> None:
    """(a): forward, log-softmax gather, a token-mean policy-gradient loss, backward, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(int(mb.mask.sum()) for mb in micro)
    for mb in micro:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        z = logits[:, :-1].float() / temperature
        logp = z.gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
        loss = -(mb.advantages * logp * mb.mask).sum() / total
        loss.backward()
    optimizer.step()


def learner_loops(cfg: Config, groups: list[Trajectory], repeats: int) -> dict[str, list[float]]:
    """Seconds of each round of (a) the bare loop and (b) train_step on the same batch,
    alternating."""
    base, _ = load_policy(cfg)
    models = {"a": base, "b": copy.deepcopy(base)}
    t = cfg.trainer  # both with the learner's own optimiser (learner/process/device.py `adamw`)
    optims = {k: adamw(m.parameters(), t.actor_lr, t.weight_decay) for k, m in models.items()}
    micro = prepare_batch(groups, StepSpec.of(cfg), AlgoModels()).micro_batches
    times = collections.defaultdict(list)
    for i in range(repeats + 1):
        for key in ("a", "b"):
            started = time.perf_counter()
            if key == "a":
                models[key].train()
                bare_step(models[key], optims[key], micro, cfg.rollout.temperature)
            else:
                train_step(models[key], optims[key], groups, cfg, AlgoModels())
            if i:  # the first round warms up
                times[key].append(time.perf_counter() - started)
    return times


def system_throughput(cfg: Config, ratio: float, steps: int) -> dict[str, float]:
    """(d): `rollctl run` for `steps` learner steps; samples/s between the end of step 2 and the
    end of the last step, timed by watching metrics.jsonl (the run's own clock stays untouched)."""
    from rollflash.rollctl.local import run_local

    cfg = cfg.model_copy(deep=True)
    cfg.trainer.async_ratio = ratio
    cfg.trainer.total_steps = steps
    cfg.run.run_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    metrics = Path(cfg.run.run_dir) / "metrics.jsonl"
    arrivals: dict[int, float] = {}
    done = threading.Event()

    def watch() -> None:  # reads only what was appended: re-reading the file cost a core's 5%
        offset = 0
        while not done.is_set():
            if metrics.exists():
                with open(metrics, "rb") as f:
                    f.seek(offset)
                    new = f.read()
                complete = new[: new.rfind(b"\n") + 1]
                offset += len(complete)
                for _ in range(complete.count(b"\n")):
                    arrivals[len(arrivals) + 1] = time.monotonic()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rc = run_local(cfg, echo=False)
    finally:
        done.set()
        watcher.join()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    if rc or len(arrivals) < steps or steps < 3:
        return {"error": f"rollctl run exited with {rc} after {len(arrivals)} steps"}
    samples = cfg.trainer.rollout_batch_size * cfg.rollout.num_return_sequences
    wall = arrivals[steps] - arrivals[2]
    step_s, train_s = (statistics.median(r[k] for r in rows[2:]) for k in PERF)
    return {
        "samples_per_s": round(samples * (steps - 2) / wall, 1),
        "learner_wait_frac": round(statistics.mean(r["perf/wait_frac"] for r in rows[2:]), 3),
        "max_staleness": max(r["async/staleness_max"] for r in rows),
        # the learner's step in this run, and the part of it that is train_step: measured in the
        # same minutes, so the host's drift does not enter their difference
        "step_ms": round(1000 * step_s, 1),
        "train_ms": round(1000 * train_s, 1),
        "besides_train_ms": round(1000 * (step_s - train_s), 1),
    }


PERF = ("perf/step_s", "perf/train_s")  # medians over the steps after the second


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--steps", type=int, default=60, help="learner steps of each whole-system run")
    p.add_argument(
        "--phase-steps",
        type=int,
        default=10,
        help="steps of the in-process learner (0: no breakdown)",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of (a), (b) and (c)")
    p.add_argument("--ratios", default="0,1")
    p.add_argument("--flame", action="store_true", help="py-spy profile of the in-process learner")
    p.add_argument("--set", action="append", default=[], dest="overrides")
    args = p.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-pipeline-")
    cfg = bench_config(args.model, args.overrides, tmp)
    engine = HFEngine(cfg.model.path)
    groups, _ = record_step(cfg, engine)
    torch.manual_seed(0)
    rounds: dict[str, list[float]] = collections.defaultdict(list)

    def measure_loops() -> None:
        rounds["c"] += [generation_time(cfg, engine) for _ in range(args.repeats)]
        for key, times in learner_loops(cfg, groups, args.repeats).items():
            rounds[key] += times

    measure_loops()
    out: dict[str, object] = {
        "workload": f"B={cfg.trainer.rollout_batch_size} n={cfg.rollout.num_return_sequences} "
        f"max_new_tokens={cfg.rollout.max_new_tokens} micro={cfg.trainer.micro_batch_size}",
    }
    if args.phase_steps > 1:
        with EmbeddedRedis(Path(tmp) / "redis") as server:
            phase_cfg = bench_config(args.model, [*args.overrides, f"redis.url={server.url}"], tmp)
            out["phases_ms"], flame = learner_phases(
                phase_cfg, groups, args.phase_steps, args.flame
            )
        if flame:
            out["flame"] = flame
    systems = {
        f"system_a{ratio:g}": system_throughput(cfg, ratio, args.steps)
        for ratio in [float(r) for r in args.ratios.split(",") if r]
    }
    if systems:
        measure_loops()  # the second round, after the system runs
    samples = cfg.trainer.rollout_batch_size * cfg.rollout.num_return_sequences
    out.update(against_ideal(rounds, samples, systems))
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


def against_ideal(
    rounds: dict[str, list[float]], samples: int, systems: dict[str, dict[str, float]]
) -> dict[str, object]:
    """The medians of (a), (b) and (c) over every round, the ideal pipeline samples / max(a, c),
    and each system run with its share of the ideal."""
    a, b, c = (statistics.median(rounds[k]) for k in "abc")
    ideal = samples / max(a, c)
    out: dict[str, object] = {
        "a_bare_s": round(a, 4),
        "b_train_step_s": round(b, 4),
        "b_over_a": round(b / a, 3),
        "c_generate_s": round(c, 4),
        "ideal_samples_per_s": round(ideal, 1),
    }
    for name, d in systems.items():
        if "samples_per_s" in d:
            d["of_ideal"] = round(d["samples_per_s"] / ideal, 3)
        out[name] = d
    return out


if __name__ == "__main__":
    main()
