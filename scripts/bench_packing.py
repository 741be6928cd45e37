"""Training throughput with token-budget packing versus padding, on one mixed-length batch.

A randomly initialised Qwen2 (a few layers; speed only) trains on one step's groups whose response
lengths follow a long-tailed log-normal. The same `train_step` runs several ways, alternately, best
of `--repeats` after a warm-up:
- `padded`: `micro_batch_size` rows per pass, sorted by length and padded to the longest of the
  pass (the learner's default; arrival order would pad more: `padded_tokens.arrival_order`);
- `packed_peak`: `trainer.token_budget` = the padded passes' peak token count (rows x width), so
  the packed passes use no more activation memory than the padded ones;
- `packed_<B>`: smaller budgets (`--budgets`);
- `dense_<B>` (`--dense-budgets`): packing as transformers runs it by itself on an SDPA model
  (position ids only: it builds a dense block-diagonal [T, T] mask, and SDPA computes all T^2
  scores of the row), instead of learner/step/packing.py's one causal SDPA call per sequence.
Every mode does the same work: the same real tokens, and the same policy loss (`loss_policy`,
its largest difference from padding is printed). Throughput is real (non-padding) tokens per
second of the process's CPU time (forward + backward + optimiser step), which another job on a
shared machine disturbs far less than wall time (`wall_tokens_per_s`, also printed); the ratios
are the numbers to read. One thread by default, for the same reason. Prints one JSON line.

    python scripts/bench_packing.py [--groups 16] [--n 8] [--micro-batch 8] [--repeats 3]
    python scripts/bench_packing.py --median 256 --cap 1536 --groups 8   # long, uneven sequences
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

from rollflash.broker.config.config import config_from_dict  # noqa: E402
from rollflash.broker.wire.schema import Sample, Trajectory  # noqa: E402
from rollflash.learner.step import packing  # noqa: E402
from rollflash.learner.step.batch import pad_groups  # noqa: E402
from rollflash.learner.step.prepare import AlgoModels  # noqa: E402
from rollflash.learner.step.train import train_step  # noqa: E402


def mixed_groups(
    count: int, n: int, vocab: int, median: int, cap: int, sigma: float = 1.0, seed: int = 0
) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        prompt = rng.integers(1, vocab, int(rng.integers(16, 48))).astype("<i4")
        samples = []
        for _ in range(n):
            t = int(min(cap, max(1, rng.lognormal(np.log(median), sigma))))
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


def timed_step(model, groups, trainer: dict) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, policy loss) of one `train_step`."""
    cfg = config_from_dict(
        {
            "rollout": {"num_return_sequences": len(groups[0].samples), "max_new_tokens": 512},
            "trainer": trainer,
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    cpu, wall = time.process_time(), time.perf_counter()
    stats = train_step(model, opt, groups, cfg, AlgoModels())
    return time.process_time() - cpu, time.perf_counter() - wall, stats["loss/policy"]


def run_mode(base, groups, trainer: dict, dense: bool) -> tuple[float, float, float, str]:
    """timed_step on a fresh copy of `base`; `dense` leaves packing to transformers' own mask."""
    model = copy.deepcopy(base)
    use_packed_sdpa = packing._use_packed_sdpa
    if dense:
        packing._use_packed_sdpa = lambda config: False
    try:
        cpu, wall, loss = timed_step(model, groups, trainer)
    finally:
        packing._use_packed_sdpa = use_packed_sdpa
    return cpu, wall, loss, model.config._attn_implementation


def random_qwen2(max_positions: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--median", type=int, default=48)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budgets", default="1024,512", help="extra token budgets, comma-separated")
    ap.add_argument("--dense-budgets", default="512", help="budgets of the dense-mask baseline")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = random_qwen2(args.cap + 64)
    groups = mixed_groups(args.groups, args.n, 512, args.median, args.cap, args.sigma)
    lengths = [len(g.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples]
    _, padded_random = peak_tokens(groups, args.micro_batch, sort=False)
    peak_sorted, padded_sorted = peak_tokens(groups, args.micro_batch, sort=True)
    budgets, dense = args.budgets.split(","), args.dense_budgets.split(",")
    modes = {
        "padded": ({"micro_batch_size": args.micro_batch}, False),
        "packed_peak": ({"token_budget": peak_sorted}, False),
        **{f"packed_{b}": ({"token_budget": int(b)}, False) for b in budgets if b},
        **{f"dense_{b}": ({"token_budget": int(b)}, True) for b in dense if b},
    }
    cpu = {name: float("inf") for name in modes}
    wall, loss, attn = dict(cpu), {}, {}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, (trainer, dense_mask) in modes.items():
            c, w, loss[name], attn[name] = run_mode(base, groups, trainer, dense_mask)
            if r:
                cpu[name], wall[name] = min(cpu[name], c), min(wall[name], w)
    real = sum(lengths)
    tok_s = {name: round(real / s, 1) for name, s in cpu.items()}
    out = {
        "sequences": len(lengths),
        "real_tokens": real,
        "longest": max(lengths),
        "padded_tokens": {"arrival_order": padded_random, "sorted": padded_sorted},
        "token_budget": peak_sorted,
        "micro_batch_size": args.micro_batch,
        "tokens_per_s": tok_s,
        "packed_over_padded": {k: round(v / tok_s["padded"], 2) for k, v in tok_s.items()},
        "wall_tokens_per_s": {name: round(real / s, 1) for name, s in wall.items()},
        "attn_implementation": attn,
        "loss_policy": loss["padded"],
        "loss_max_diff": max(abs(v - loss["padded"]) for v in loss.values()),
        "threads": args.threads,
        "repeats": args.repeats,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
