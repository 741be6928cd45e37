"""Benchmark: publishing a weight version against `cp` of the same bytes on the same disk.

    python scripts/bench_publish.py [--gb 1.0] [--dir /tmp]

Builds a state dict of about `--gb` GB (bf16 matrices shaped like a transformer's), publishes it
with `WeightStore.publish` (the learner's path: safetensors written and hashed in one pass,
fsynced, manifest last, atomic rename), then copies the published file with `cp` and fsyncs the
copy (`sync FILE`), on the same filesystem. Prints one JSON line: both times and their ratio
(publish / cp; the goal is <= 1.5). The page cache is not dropped: both runs write from memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rollflash.broker.weights import MODEL_FILE, WeightStore


def state_dict(gb: float) -> dict[str, torch.Tensor]:
    """bf16 tensors of about `gb` GB: [4096, 4096] blocks plus a [128, 4096] remainder."""
    total = int(gb * 1e9) // 2  # bf16 elements
    block = 4096 * 4096
    out = {f"layers.{i}.weight": torch.randn(4096, 4096).bfloat16() for i in range(total // block)}
    out["norm.weight"] = torch.ones(128, 4096, dtype=torch.bfloat16)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_publish-", dir=args.dir))
    try:
        weights = state_dict(args.gb)
        store = WeightStore(root / "run")
        t0 = time.monotonic()
        info = store.publish(weights, version=1, step=1)
        publish_s = time.monotonic() - t0
        src = Path(info.path) / MODEL_FILE
        t0 = time.monotonic()
        cp = ["cp", "--reflink=never", str(src), str(root / "copy.safetensors")]
        subprocess.run(cp, check=True)
        subprocess.run(["sync", str(root / "copy.safetensors")], check=True)
        cp_s = time.monotonic() - t0
        size = src.stat().st_size
        print(
            json.dumps(
                {
                    "bench": "publish",
                    "bytes": size,
                    "publish_s": round(publish_s, 3),
                    "cp_s": round(cp_s, 3),
                    "ratio": round(publish_s / cp_s, 3),
                    "publish_gb_per_s": round(size / publish_s / 1e9, 3),
                }
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
