"""GPU figures of the learner at Qwen2.5-0.5B's shapes (docs/gpu.md; scripts/gpu_check.py runs
it): one JSON line.

    python scripts/gpu_bench.py                 # on a GPU: random Qwen2, 0.5B, vocabulary 151,936
    python scripts/gpu_bench.py --device cpu --tiny    # the same code on a tiny model (a test)

A randomly initialised Qwen2 with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads / 2 KV
heads, MLP 4864, tied embedding of 151,936: 494M parameters) trains `train_step`s with float32
masters in bf16 (`model.dtype: auto` on a GPU) on 4 groups of 4 samples of PROMPT + RESPONSE
tokens, and reports for each of: padded micro-batches, with and without gradient checkpointing,
and packed micro-batches (`trainer.token_budget`, the packed-SDPA path: one host sync per layer
for the sequence lengths):
- `tokens_per_s` over STEPS steps after one warm-up step, `peak_gib` (torch's peak allocated),
  and `mfu`: 6 x non-embedding parameters + 12 x layers x hidden x sequence FLOPs per token
  (PaLM, Chowdhery et al. 2022, appendix B), over the GPU's dense bf16 peak (PEAK_TFLOPS; null
  for a GPU not listed);
- learner/models/memory.py's estimate of the same step (`estimate_gib`), to compare with the peak;
and the seconds to publish a version at 0.5B (full_state_dict in bf16 + WeightStore.publish:
cast, one copy to the host, write and hash) and to read it back verified into the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

use_checkout()

from rollflash.broker.config.config import config_from_dict  # noqa: E402
from rollflash.broker.weights.weights import WeightStore  # noqa: E402
from rollflash.learner.models.memory import estimate  # noqa: E402
from rollflash.learner.process.device import adamw, cuda_defaults, set_alloc_conf  # noqa: E402
from rollflash.learner.process.dist import Dist, full_state_dict  # noqa: E402
from rollflash.learner.step.prepare import AlgoModels  # noqa: E402
from rollflash.learner.step.train import train_step  # noqa: E402

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)  # fmt: skip
# dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "RTX 4090": 165.0}  # fmt: skip
STEPS = 2


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def groups(vocab: int, prompt: int, response: int):
    import numpy as np

    from rollflash.broker.wire.schema import Sample, Trajectory

    rng = np.random.default_rng(0)
    out = []
    for g in range(4):
        samples = [
            Sample(rng.integers(4, vocab, response).astype("<i4"),
                   rng.uniform(-3, -0.5, response).astype("<f4"), np.zeros(response, "<i4"),
                   reward=float(rng.random()), finished=True)
            for _ in range(4)
        ]  # fmt: skip
        ids = rng.integers(4, vocab, prompt).astype("<i4")
        out.append(Trajectory(f"t{g}", f"p{g}", f"g{g}", "bench", 0, 0, ids, samples))
    return out


def config(packed: bool, checkpointing: bool, prompt: int, response: int, device: torch.device):
    rows = prompt + response
    trainer = {"token_budget": 4 * rows} if packed else {"micro_batch_size": 4}
    return config_from_dict(
        {
            "rollout": {"num_return_sequences": 4, "max_new_tokens": response},
            "trainer": {**trainer, "rollout_batch_size": 4, "device": device.type,
                        "gradient_checkpointing": checkpointing, "actor_lr": 1e-6},
        }
    )  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_figures(model, shape: dict, cfg, data, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if cfg.trainer.gradient_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    opt = adamw(model.parameters(), cfg.trainer.actor_lr, 0.0)
    dist = Dist(device=device)
    train_step(model, opt, data, cfg, AlgoModels(), dist)  # warm-up (and AdamW's state)
    sync(device)
    started = time.perf_counter()
    for _ in range(STEPS):
        train_step(model, opt, data, cfg, AlgoModels(), dist)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(g.prompt_ids) + len(s.response_ids) for g in data for s in g.samples)
    rate = tokens * STEPS / seconds
    params = sum(p.numel() for p in model.parameters())
    body = params - shape["vocab_size"] * shape["hidden_size"]  # tied: the embedding once
    seq = len(data[0].prompt_ids) + len(data[0].samples[0].response_ids)
    flops = 6 * body + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq
    peak = peak_flops(device)
    est = estimate(cfg, model.config, params, 1, device) if device.type == "cuda" else None
    del opt
    return {
        "tokens_per_s": round(rate, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
        "estimate_gib": round(
            est.states_gib
            + (est.checkpointed_gib if cfg.trainer.gradient_checkpointing else est.activations_gib),
            2,
        )
        if est
        else None,
        "mfu": round(rate * flops / peak, 4) if peak else None,
    }


def publish_figures(model, work: Path) -> dict:
    """Seconds to publish a version of `model` in bf16, and to read it back verified (on the
    host) into the model on its device (the hf engine's own reload, straight onto its device,
    is the generate part's)."""
    from rollflash.broker.weights.weight_chain import verified_tensors

    store = WeightStore(work / "store")
    device = next(model.parameters()).device
    started = time.perf_counter()
    weights = full_state_dict(model, torch.bfloat16)
    store.publish(weights, version=1, step=1)
    published = time.perf_counter()
    with torch.no_grad():
        model.load_state_dict(verified_tensors(store, 1), strict=False)
    sync(device)
    return {
        "publish_s": round(published - started, 2),
        "reload_s": round(time.perf_counter() - published, 2),
        "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short rows (a test)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU; use --device cpu --tiny")
    from transformers import AutoModelForCausalLM, Qwen2Config

    set_alloc_conf("expandable_segments:True")  # the learner's default (learner/process/device.py)
    device = torch.device(args.device)
    cuda_defaults(device, tf32=True)
    shape = TINY if args.tiny else QWEN25_05B
    prompt, response = (8, 8) if args.tiny else (args.prompt, args.response)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**shape, tie_word_embeddings=True), dtype=torch.float32
        )
    data = groups(shape["vocab_size"], prompt, response)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": 16 * (prompt + response),
    }
    for name, packed, ckpt in (
        ("padded", False, False),
        ("checkpointed", False, True),
        ("packed", True, False),
    ):
        report[name] = train_figures(
            model, shape, config(packed, ckpt, prompt, response, device), data, device
        )
    with tempfile.TemporaryDirectory() as work:
        report.update(publish_figures(model, Path(work)))
    report["ok"] = all(report[k]["tokens_per_s"] > 0 for k in ("padded", "checkpointed", "packed"))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
