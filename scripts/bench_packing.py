"""Training throughput with token-budget packing versus padding, on one mixed-length batch.

A randomly initialised Qwen2 (a few layers; speed only) trains on one step's groups whose response
lengths follow a long-tailed log-normal. The same `train_step` runs two ways, alternately, best
of `--repeats` after a warm-up:
- `padded`: `micro_batch_size` rows per pass, sorted by length and padded to the longest of the
  pass (the learner's default; arrival order would pad more: `padded_tokens.arrival_order`);
- `packed_peak`: `trainer.token_budget` = the padded passes' peak token count (rows x width), so
  the packed passes use no more activation memory than the padded ones;
- `packed_<B>`: smaller budgets (`--budgets`). Without flash attention the packed row's attention
  is a [T, T] block-diagonal mask, so its cost grows with T^2: smaller budgets trade fewer
  wasted attention scores for more passes.
Throughput is real (non-padding) tokens per second of forward + backward + optimiser step; the
ratios are the numbers to read. Prints one JSON line.

    python scripts/bench_packing.py [--groups 16] [--n 8] [--micro-batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.broker.config import config_from_dict  # noqa: E402
from rollflash.broker.schema import Sample, Trajectory  # noqa: E402
from rollflash.learner.batch import pad_groups  # noqa: E402
from rollflash.learner.prepare import AlgoModels  # noqa: E402
from rollflash.learner.train import train_step  # noqa: E402


def mixed_groups(
    count: int, n: int, vocab: int, median: int, cap: int, seed: int = 0
) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        prompt = rng.integers(1, vocab, int(rng.integers(16, 48))).astype("<i4")
        samples = []
        for _ in range(n):
            t = int(min(cap, max(1, rng.lognormal(np.log(median), 1.0))))
            samples.append(
                Sample(
                    rng.integers(1, vocab, t).astype("<i4"),
                    rng.uniform(-4, -1, t).astype("<f4"),
                    np.zeros(t, "<i4"),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        groups.append(Trajectory(f"t{g}", f"p{g}", f"g{g}", "bench", 0, 0, prompt, samples))
    return groups


def peak_tokens(groups: list[Trajectory], micro: int, sort: bool) -> tuple[int, int]:
    """(peak rows x width over the padded passes, padded tokens in all)."""
    full = pad_groups(groups)
    lengths = full.lengths
    order = torch.argsort(lengths, stable=True) if sort else torch.arange(len(lengths))
    chunks = [order[i : i + micro] for i in range(0, len(order), micro)]
    sizes = [len(c) * int(lengths[c].max()) for c in chunks]
    return max(sizes), sum(sizes)


def timed_step(model, groups, trainer: dict) -> float:
    cfg = config_from_dict(
        {
            "rollout": {"num_return_sequences": len(groups[0].samples), "max_new_tokens": 512},
            "trainer": trainer,
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    train_step(model, opt, groups, cfg, AlgoModels())
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--median", type=int, default=48)
    ap.add_argument("--cap", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budgets", default="1024,512", help="extra token budgets, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    base = Qwen2ForCausalLM(config)
    groups = mixed_groups(args.groups, args.n, config.vocab_size, args.median, args.cap)
    real = sum(len(g.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    _, padded_random = peak_tokens(groups, args.micro_batch, sort=False)
    peak_sorted, padded_sorted = peak_tokens(groups, args.micro_batch, sort=True)
    modes = {
        "padded": {"micro_batch_size": args.micro_batch},
        "packed_peak": {"token_budget": peak_sorted},
        **{f"packed_{b}": {"token_budget": int(b)} for b in args.budgets.split(",") if b},
    }
    best = {name: float("inf") for name in modes}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, trainer in modes.items():
            best[name] = min(best[name], timed_step(copy.deepcopy(base), groups, trainer))
    tok_s = {name: round(real / s, 1) for name, s in best.items()}
    print(
        json.dumps(
            {
                "sequences": args.groups * args.n,
                "real_tokens": real,
                "padded_tokens": {"arrival_order": padded_random, "sorted": padded_sorted},
                "token_budget": peak_sorted,
                "micro_batch_size": args.micro_batch,
                "tokens_per_s": tok_s,
                "packed_over_padded": {
                    k: round(v / tok_s["padded"], 2) for k, v in tok_s.items() if k != "padded"
                },
                "threads": args.threads,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
