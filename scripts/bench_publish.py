"""Benchmark: publishing a weight version against `cp` of the same bytes on the same disk.

    python scripts/bench_publish.py [--gb 1.0] [--dir /tmp] [--rounds 5]

Builds a state dict of about `--gb` GB (bf16 matrices shaped like a transformer's), publishes it
with `WeightStore.publish` (the learner's path: safetensors written once while its chunks are
hashed on the other cores, fsynced, manifest last, atomic rename), then copies the published file
with `cp` and fsyncs the copy (`sync FILE`), on the same filesystem; `--rounds` times, each round
deleting both before the next. Prints one JSON line: the median times, their ratio (publish / cp;
the goal is <= 1.5) and each round's ratio, so a round slowed by other jobs on a shared machine
shows as such. The page cache is not dropped: both sides write from memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rollflash.broker.weights.weights import MODEL_FILE, WeightStore


def state_dict(gb: float) -> dict[str, torch.Tensor]:
    """bf16 tensors of about `gb` GB: [4096, 4096] blocks plus a [128, 4096] remainder."""
    total = int(gb * 1e9) // 2  # bf16 elements
    block = 4096 * 4096
    out = {f"layers.{i}.weight": torch.randn(4096, 4096).bfloat16() for i in range(total // block)}
    out["norm.weight"] = torch.ones(128, 4096, dtype=torch.bfloat16)
    return out


def one_round(
    store: WeightStore, weights: dict[str, torch.Tensor], root: Path
) -> tuple[float, float, int]:
    """(publish seconds, cp + sync seconds, bytes) of one publish and one copy of its file."""
    t0 = time.monotonic()
    info = store.publish(weights, version=1, step=1)
    publish_s = time.monotonic() - t0
    src, dst = Path(info.path) / MODEL_FILE, root / "copy.safetensors"
    t0 = time.monotonic()
    subprocess.run(["cp", "--reflink=never", str(src), str(dst)], check=True)
    subprocess.run(["sync", str(dst)], check=True)
    cp_s = time.monotonic() - t0
    size = src.stat().st_size
    shutil.rmtree(info.path)
    dst.unlink()
    return publish_s, cp_s, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=5, help="publish + cp rounds (medians reported)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_publish-", dir=args.dir))
    try:
        weights = state_dict(args.gb)
        store = WeightStore(root / "run")
        rounds = [one_round(store, weights, root) for _ in range(args.rounds)]
        publish_s = statistics.median(r[0] for r in rounds)
        cp_s = statistics.median(r[1] for r in rounds)
        size = rounds[0][2]
        print(
            json.dumps(
                {
                    "bench": "publish",
                    "bytes": size,
                    "cores": len(os.sched_getaffinity(0)),
                    "publish_s": round(publish_s, 3),
                    "cp_s": round(cp_s, 3),
                    "ratio": round(publish_s / cp_s, 3),
                    "round_ratios": [round(a / b, 2) for a, b, _ in rounds],
                    "publish_gb_per_s": round(size / publish_s / 1e9, 3),
                }
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
