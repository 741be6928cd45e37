"""Benchmark: the learner's memory, Redis's memory and the checkpoint size over a long simulated
run.

Runs the real system with `rollctl run`: an embedded redis-server, the learner's real control loop
(admission, collection, duplicate and staleness filters, publishing, checkpoints every
`--checkpoint-every` steps) and 2 generator processes, with the simulated engine and a simulated
learner step (`rollout.engine: sim`, `sim.learner_step_s`), so that thousands of steps take minutes
and the learner's own state, and the run's keys in Redis, are what grows, if anything does.
Every `--sample-s` seconds it samples the learner process's resident memory (VmRSS in /proc:
Linux only), Redis's `used_memory` and the length of every stream of the run, and the size of
the learner's latest checkpoint directory, with the learner's step (the run hash).

Prints one JSON line: the first and last samples taken once the learner had trained
`--warmup-steps` steps and run `--warmup-s` seconds (start-up allocations settle, and the
acknowledged trajectories Redis keeps for `redis.keep_acknowledged_s`, 30 s, fill their
window), the RSS, Redis memory and checkpoint bytes of both, their ratios last / first, and the
checkpoint's `seen` ids at the end.

    .venv/bin/python scripts/bench_long_run.py [--steps 5000] [--set key=value ...]
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

import redis

WORKLOAD = [
    "rollout.engine=sim",
    "rollout.num_return_sequences=2",
    "rollout.max_new_tokens=16",
    "rollout.num_rollout_workers=2",
    "trainer.rollout_batch_size=16",
    "trainer.async_ratio=1",
    "trainer.wait_timeout_s=120",
    "sim.per_token_s=0.0001",
    "sim.length_median=4",
    "sim.length_sigma=0.3",
    "sim.learner_step_s=0.002",
    "eval.size=1",
    "run.torch_threads=1",
]


def _learner_rss(parent: int) -> int | None:
    """Resident bytes of the `start-learner` child of process `parent`; None if there is none."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent or b"start-learner" not in (proc / "cmdline").read_bytes():
                continue
            status = (proc / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def _checkpoint_bytes(run_dir: Path) -> tuple[int, int]:
    """(bytes of the latest checkpoint directory, ids in its `seen`); (0, 0) before the first."""
    root = run_dir / "checkpoints"
    try:
        latest = root / f"step{int((root / 'LATEST').read_text()):08d}"
        size = sum(f.stat().st_size for f in latest.iterdir())
        seen = json.loads((latest / "state.json").read_text())["seen"]
    except (FileNotFoundError, ValueError):  # not written yet, or replaced while reading
        return 0, 0
    ids = len(seen) if isinstance(seen, list) else sum(len(v) for v in seen.values())
    return size, ids


def _redis(r: redis.Redis | None, run_id: str) -> tuple[int, int, dict[str, int]]:
    """(the learner's step, Redis used_memory, entries of each of the run's streams)."""
    if r is None:
        return 0, 0, {}
    prefix = f"rl:{run_id}:"
    try:
        step = int(r.hget(f"{prefix}run", "step") or 0)
        used = int(r.info("memory")["used_memory"])
        streams = [k for k in r.scan_iter(match=f"{prefix}*") if r.type(k) == b"stream"]
        return step, used, {k.decode()[len(prefix) :]: r.xlen(k) for k in streams}
    except redis.RedisError:
        return 0, 0, {}


def _by_quarter(settled: list[dict], field: str, scale: float) -> list[float]:
    """The median of `field` in each quarter of the settled samples, by step: flat over the run
    when the quarters agree, growing with its length when they climb."""
    n = len(settled)
    quarters = [settled[i * n // 4 : (i + 1) * n // 4] for i in range(4)]
    return [round(statistics.median(s[field] for s in q) / scale, 2) for q in quarters if q]


def run(steps: int, every: int, sample_s: float, overrides: list[str], workdir: Path) -> list:
    run_dir, run_id = workdir / "run", "bench-long"
    sets = WORKLOAD + overrides
    sets += [f"trainer.total_steps={steps}", f"trainer.checkpoint_every={every}"]
    sets += [f"run.run_id={run_id}", f"run.run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--generators", "2"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples, r, started = [], None, time.monotonic()
    while proc.poll() is None:
        time.sleep(sample_s)
        sock = run_dir / "redis" / "redis.sock"
        if r is None and sock.exists():
            r = redis.Redis(unix_socket_path=str(sock))
        rss = _learner_rss(proc.pid)
        if rss is None:
            continue
        size, ids = _checkpoint_bytes(run_dir)
        step, used, streams = _redis(r, run_id)
        samples.append(
            {"t": time.monotonic() - started, "step": step, "rss": rss, "redis": used,
             "entries": sum(streams.values()), "streams": streams, "ckpt_bytes": size,
             "seen": ids}
        )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"rollctl run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--warmup-s", type=float, default=45.0)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--label", default="", help="a note carried into the JSON line")
    args = p.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        samples = run(args.steps, args.checkpoint_every, args.sample_s, args.overrides, Path(tmp))
    settled = [
        s
        for s in samples
        if s["step"] >= args.warmup_steps and s["t"] >= args.warmup_s and s["ckpt_bytes"]
    ]
    if len(settled) < 2:
        raise SystemExit(f"too few samples after step {args.warmup_steps}: {samples[-3:]}")
    first, last = settled[0], settled[-1]
    print(
        json.dumps(
            {
                "bench": "long_run",
                "label": args.label,
                "steps": args.steps,
                "wall_s": round(time.monotonic() - started, 1),
                "samples": len(samples),
                "first": first,
                "last": last,
                "rss_mib_first": round(first["rss"] / 2**20, 1),
                "rss_mib_last": round(last["rss"] / 2**20, 1),
                "rss_ratio": round(last["rss"] / first["rss"], 3),
                "ckpt_bytes_first": first["ckpt_bytes"],
                "ckpt_bytes_last": last["ckpt_bytes"],
                "ckpt_ratio": round(last["ckpt_bytes"] / first["ckpt_bytes"], 3),
                "rss_mib_max": round(max(s["rss"] for s in settled) / 2**20, 1),
                "redis_mib_first": round(first["redis"] / 2**20, 2),
                "redis_mib_last": round(last["redis"] / 2**20, 2),
                "redis_ratio": round(last["redis"] / first["redis"], 3),
                "redis_mib_max": round(max(s["redis"] for s in settled) / 2**20, 2),
                "stream_entries_first": first["entries"],
                "stream_entries_last": last["entries"],
                "stream_entries_max": max(s["entries"] for s in settled),
                "redis_mib_by_quarter": _by_quarter(settled, "redis", 2**20),
                "rss_mib_by_quarter": _by_quarter(settled, "rss", 2**20),
                "stream_entries_by_quarter": _by_quarter(settled, "entries", 1),
                "workload": WORKLOAD + args.overrides,
            }
        )
    )


if __name__ == "__main__":
    main()
