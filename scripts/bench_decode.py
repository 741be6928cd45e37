"""Benchmark: the learner's decode of one step's trajectory entries, with and without the
decoder's fast paths (broker/wire/schema.py `_decode_sample`, broker/wire/wire.py `array_from`).

The entries are what generators write for the demo (configs/demo.yaml: 32 groups of 8 samples
of up to 4 tokens) and for long answers (8 groups of 8 samples of 512 tokens), encoded by
`encode_trajectory` and decoded by `decode_trajectory` under the learner's limits. "checked"
decodes the same entries with both fast paths swapped for their checked paths, which
tests/unit/test_wire_fast_paths.py proves give the same values and refusals. Rounds alternate
between the two; each figure is the best round's milliseconds per step.

Prints one JSON line: per workload the ms per step of each path and checked / fast.

    .venv/bin/python scripts/bench_decode.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.broker.wire import schema, wire  # noqa: E402
from rollflash.broker.wire.schema import Sample, Trajectory, decode_trajectory  # noqa: E402
from rollflash.broker.wire.wire import WireLimits  # noqa: E402

WORKLOADS = {"demo": (32, 8, 4), "long": (8, 8, 512)}  # groups, samples per group, tokens
LIMITS = WireLimits(max_bytes=1 << 24, vocab_size=32_000, max_samples=8)


def entries(groups: int, n: int, tokens: int) -> list[dict[bytes, bytes]]:
    """One step's entries as redis-py returns them (bytes keys and values)."""
    out = []
    for k in range(groups):
        samples = [
            Sample(
                np.arange(3, 3 + tokens, dtype=np.int32),
                np.full(tokens, -0.5, np.float32),
                np.zeros(tokens, np.int32),
                1.0,
                True,
                "42",
            )
            for _ in range(n)
        ]
        prompt = np.arange(3, 23, dtype=np.int32)
        t = Trajectory(f"g{k}", f"train-{k}", f"g{k}", "gen-0", 0, 0, prompt, samples)
        fields = schema.encode_trajectory(t)
        out.append(
            {
                key.encode(): v if isinstance(v, bytes) else str(v).encode()
                for key, v in fields.items()
            }
        )
    return out


@contextmanager
def checked_paths():
    """Decode through the checked paths only (as if the fast paths did not exist)."""
    saved = schema._decode_sample, schema.array_from
    schema._decode_sample, schema.array_from = schema._decode_sample_checked, wire._array_checked
    try:
        yield
    finally:
        schema._decode_sample, schema.array_from = saved


def step_ms(step: list[dict[bytes, bytes]], repeats: int = 10) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        for fields in step:
            decode_trajectory(fields, LIMITS)
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    result = {}
    for name, shape in WORKLOADS.items():
        step = entries(*shape)
        fast, checked = [], []
        for _ in range(args.rounds):
            fast.append(step_ms(step))
            with checked_paths():
                checked.append(step_ms(step))
        result[name] = {
            "fast_ms": round(min(fast), 3),
            "checked_ms": round(min(checked), 3),
            "checked_over_fast": round(min(checked) / min(fast), 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
