"""GPU smoke check of the learner: one process, every strategy, one JSON line.

    torchrun --standalone --nproc-per-node 1 scripts/gpu_smoke.py            # on a GPU machine
    python scripts/gpu_smoke.py --device cpu --small                        # the CPU path (a test)

Needs torch, transformers and safetensors (and this package's learner code), no Redis, no vLLM.
A tiny random Qwen2 is trained for single / DDP / FSDP2 (a one-rank group), with and without
packing, in `model.dtype: bfloat16` (fp32 masters, bf16 compute), checking that:
- parameters and gradients are on the device and float32 (`masters_fp32`);
- the loss is finite;
- bf16 log-probs match the CPU float32 ones within LOGP_TOL (bf16's 8 mantissa bits);
- packed log-probs equal padded ones within PACK_TOL (float32 compute);
- the published version reloads to the same bytes (sha256) and greedy outputs match;
- checkpoint (DCP) and resume give the uninterrupted run's weights within RESUME_TOL.
Without --small it then builds a random Qwen2 of about 0.5B parameters on the device and reports
peak memory and tokens/s of a training step with and without gradient checkpointing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, Qwen2Config

from rollflash.broker.config import config_from_dict
from rollflash.broker.schema import Sample, Trajectory
from rollflash.broker.weights import WeightStore
from rollflash.learner.checkpoint_io import Trainables, load_dcp, save_dcp
from rollflash.learner.dist import Dist, compute_context, full_state_dict, shard
from rollflash.learner.logprobs import token_logprobs
from rollflash.learner.prepare import AlgoModels
from rollflash.learner.train import train_step

LOGP_TOL = 0.1  # bf16 compute vs float32 on CPU, per token log-prob
PACK_TOL = 1e-4  # packed vs padded, float32 compute
RESUME_TOL = 1e-5  # checkpointed-and-resumed vs uninterrupted weights
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)  # fmt: skip
HALF_B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
)  # fmt: skip  ~0.5B, as Qwen2-0.5B


def join_group(device: torch.device) -> Dist:
    """A one-rank group (torchrun's, or a local one) so that DDP and FSDP can wrap."""
    if "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Dist(0, 1, device)


def groups(vocab: int, count: int, n: int = 4, prompt: int = 6, resp: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(count):
        samples = []
        for _ in range(n):
            k = int(rng.integers(2, resp + 1))
            samples.append(
                Sample(
                    rng.integers(3, vocab, k).astype("<i4"),
                    rng.uniform(-3, -0.5, k).astype("<f4"),
                    np.zeros(k, "<i4"),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        ids = rng.integers(3, vocab, prompt).astype("<i4")
        out.append(Trajectory(f"t{g}", f"p{g}", f"g{g}", "smoke", 0, 0, ids, samples))
    return out


def config(packing: bool, model_dtype: str):
    trainer = {"token_budget": 64} if packing else {"micro_batch_size": 4}
    return config_from_dict(
        {
            "model": {"dtype": model_dtype},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 10},
            "trainer": {**trainer, "logprob_chunk": 16},
        }
    )


def wrap(policy: torch.nn.Module, strategy: str, dist: Dist, dtype: str) -> torch.nn.Module:
    if strategy == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DistributedDataParallel(policy, device_ids=ids)
    return shard(policy, dtype) if strategy == "fsdp" else policy


def masters_fp32(model: torch.nn.Module, device: torch.device) -> bool:
    return all(
        p.dtype == torch.float32 and p.device.type == device.type and p.grad is not None
        and p.grad.dtype == torch.float32 and p.grad.device.type == device.type
        for p in model.parameters()
    )  # fmt: skip


def logprob_checks(base, device, dist, dtype) -> dict[str, float]:
    """bf16 on the device vs float32 on CPU, and packed vs padded (float32)."""
    ids = torch.randint(3, base.config.vocab_size, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    sel = mask[:, 1:].bool()
    with torch.no_grad():
        ref, _ = token_logprobs(base, ids, mask, 1.0)
        dev = copy.deepcopy(base).to(device)
        with compute_context(dev, dist, dtype):
            low, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0, chunk=8)
        packed, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0, packed=True)
        padded, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0)
    return {
        "bf16_vs_cpu_fp32": float((low.cpu() - ref)[sel].abs().max()),
        "packed_vs_padded": float((packed - padded)[sel.to(device)].abs().max()),
    }


def publish_reload(model, base, work: Path, step: int) -> bool:
    """Publish in bf16, reload the verified bytes, and compare greedy continuations."""
    weights = full_state_dict(model, torch.bfloat16)
    store = WeightStore(work / f"run{step}")
    store.publish(weights, version=step, step=step)
    from rollflash.broker.weight_stream import verified_tensors

    reloaded = copy.deepcopy(base).bfloat16()
    reloaded.load_state_dict(verified_tensors(store, step), strict=False)
    memory = copy.deepcopy(base).bfloat16()
    memory.load_state_dict(weights, strict=False)
    prompt = torch.randint(3, base.config.vocab_size, (2, 5))
    outs = [
        m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                   max_new_tokens=6, pad_token_id=0)
        for m in (reloaded, memory)
    ]  # fmt: skip
    return bool(torch.equal(outs[0], outs[1]))


def run_case(base, strategy, packing, dist, dtype, work: Path) -> dict:
    """Train two steps, with a DCP checkpoint after the first, and resume from it."""
    cfg = config(packing, dtype)
    data = groups(base.config.vocab_size, 4)

    def fresh():
        m = wrap(copy.deepcopy(base).to(dist.device), strategy, dist, dtype)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    model, opt = fresh()
    stats = train_step(model, opt, data[:2], cfg, AlgoModels(), dist)
    ckpt = work / f"ckpt-{strategy}-{packing}"
    save_dcp(Trainables(model, opt), ckpt)
    train_step(model, opt, data[2:], cfg, AlgoModels(), dist)
    uninterrupted = full_state_dict(model)
    model2, opt2 = fresh()
    load_dcp(Trainables(model2, opt2), ckpt)
    train_step(model2, opt2, data[2:], cfg, AlgoModels(), dist)
    resumed = full_state_dict(model2)
    diff = max(float((resumed[k] - w).abs().max()) for k, w in uninterrupted.items())
    return {
        "masters_fp32": masters_fp32(model, dist.device),
        "loss_finite": bool(np.isfinite(stats["loss/policy"])),
        "resume_max_diff": diff,
        "published_greedy_match": publish_reload(model, base, work, 1 + len(os.listdir(work))),
    }


def throughput(device: torch.device, dist: Dist, checkpointing: bool, steps: int = 3) -> dict:
    """A random ~0.5B Qwen2 built on the device: peak memory and tokens/s of training steps."""
    torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**HALF_B), dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cfg = config(False, "bfloat16")
    data = groups(HALF_B["vocab_size"], 4, n=4, prompt=256, resp=256)
    tokens = sum(len(g.prompt_ids) + len(s.response_ids) for g in data for s in g.samples)
    train_step(model, opt, data, cfg, AlgoModels(), dist)  # warm-up
    torch.cuda.synchronize(device)
    t0 = time.monotonic()
    for _ in range(steps):
        train_step(model, opt, data, cfg, AlgoModels(), dist)
    torch.cuda.synchronize(device)
    return {
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        "tokens_per_s": round(tokens * steps / (time.monotonic() - t0), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny model only (no 0.5B figures)")
    p.add_argument("--strategies", default="single,ddp,fsdp", help="comma-separated subset")
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if args.device == "cpu":
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(device)
    dist = join_group(device)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Qwen2Config(**TINY), dtype=torch.float32)
    report: dict = {"device": str(device), "torch": torch.__version__, "tolerances": {
        "logp": LOGP_TOL, "packed": PACK_TOL, "resume": RESUME_TOL}}  # fmt: skip
    report.update(logprob_checks(base, device, dist, "bfloat16"))
    cases = {}
    with tempfile.TemporaryDirectory() as work:
        for strategy in args.strategies.split(","):
            for packing in (False, True):
                name = f"{strategy}{'-packed' if packing else ''}"
                cases[name] = run_case(base, strategy, packing, dist, "bfloat16", Path(work))
    report["cases"] = cases
    if not args.small and device.type == "cuda":
        report["qwen2_0.5b"] = {
            f"checkpointing_{c}": throughput(device, dist, c) for c in (False, True)
        }
    report["ok"] = (
        report["bf16_vs_cpu_fp32"] <= LOGP_TOL
        and report["packed_vs_padded"] <= PACK_TOL
        and all(c["masters_fp32"] and c["loss_finite"] and c["published_greedy_match"]
                and c["resume_max_diff"] <= RESUME_TOL for c in cases.values())
    )  # fmt: skip
    print(json.dumps(report))
    torch_dist.destroy_process_group()
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
