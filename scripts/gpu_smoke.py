"""GPU check of the learner's correctness on 1 or N ranks, and of a stalled rank (docs/gpu.md;
scripts/gpu_check.py runs it). Prints one JSON line (rank 0).

    torchrun --standalone --nproc-per-node 1 scripts/gpu_smoke.py   # every strategy, one rank
    torchrun --standalone --nproc-per-node 2 scripts/gpu_smoke.py   # two ranks against one
    python scripts/gpu_smoke.py --device cpu                        # the same on CPU (gloo)
    ... --stall 10    # 2 ranks: rank 1 stops itself, rank 0 must end within 10 s (plus a margin)

Rank 0 saves a tiny random Qwen2 with a tied embedding and a tokenizer; every case builds it
through learner/models/policy.py `load_policy` (with several ranks: on the meta device, broadcast from
rank 0, wrapped for the strategy, the tie checked) and trains two steps of 4 groups, each 2 PPO
mini-batches x 2 epochs, in `model.dtype: bfloat16` (float32 masters), checking that
- parameters and gradients are float32 on the device (`masters_fp32`), the loss is finite, every
  update was made (`updates` = 4 a step) and the tie still holds on every rank (`tied`);
- a version published in bf16 reloads, through the weight store's verified read, into greedy
  generations equal to those of the weights in memory (`published_greedy_match`);
- a DCP checkpoint after step 1, resumed, gives the uninterrupted weights (`resume_max_diff`);
- on one rank: bf16 log-probs are within LOGP_TOL of CPU float32 and packed within PACK_TOL of
  padded; on N ranks: float32 training of the ranks' shares (TF32 off) gives one rank's weights
  within RANKS_TOL (`vs_one_rank_max_diff`).
Ranks that share a GPU (more ranks than GPUs) cannot use NCCL, which refuses two ranks on one
device: their group is gloo, which all-reduces and broadcasts CUDA tensors (DDP, the broadcast
of the weights from rank 0) but has no all-gather or reduce-scatter for them, so FSDP is
reported as skipped there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

use_checkout()

from rollflash.broker.config.config import config_from_dict  # noqa: E402
from rollflash.broker.weights.weights import WeightStore  # noqa: E402
from rollflash.broker.wire.schema import Sample, Trajectory  # noqa: E402
from rollflash.learner.durability.checkpoint_io import Trainables, load_dcp, save_dcp  # noqa: E402
from rollflash.learner.models.policy import load_policy  # noqa: E402
from rollflash.learner.process.device import adamw, process_group_backend  # noqa: E402
from rollflash.learner.process.dist import (  # noqa: E402
    CollectiveTimeout,
    Dist,
    compute_context,
    full_state_dict,
    shard,
    split_quotas,
)
from rollflash.learner.step.logprobs import token_logprobs  # noqa: E402
from rollflash.learner.step.prepare import AlgoModels  # noqa: E402
from rollflash.learner.step.train import train_step  # noqa: E402

LOGP_TOL = 0.1  # bf16 compute vs float32 on CPU, per token log-prob (8 mantissa bits)
PACK_TOL = 1e-4  # packed vs padded, float32 compute
RESUME_TOL = 1e-5  # checkpointed-and-resumed vs uninterrupted weights
RANKS_TOL = 1e-5  # N ranks vs one, float32 (as tests/integration/test_distributed_learner.py)
STALL_MARGIN_S = 30.0  # a stalled collective ends within dist_timeout_s plus this
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
GROUPS, STEPS = 4, 2  # groups per step (rollout_batch_size), steps per case


def join(device: str, timeout_s: float) -> tuple[Dist, str]:
    """This rank's group (torchrun's, or a one-rank group of its own, which DDP and FSDP need),
    on LOCAL_RANK's GPU (mod the GPUs there are); returns it and its backend string."""
    if "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        gpus = torch.cuda.device_count()
        dev = torch.device("cuda", local % gpus)
        torch.cuda.set_device(dev)
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", world)) > gpus
        # gloo alone, not "cpu:gloo,cuda:gloo": object collectives then stage on the host
        backend = "gloo" if shared else process_group_backend(dev)
    torch_dist.init_process_group(
        backend,
        device_id=dev if "nccl" in backend else None,
        timeout=timedelta(seconds=timeout_s),
    )
    rank = torch_dist.get_rank()
    return Dist(rank, world, dev, timeout_s), backend


def save_model(out: Path) -> Path:
    """A random tiny Qwen2 with a tied embedding and the tiny character tokenizer."""
    from make_tiny_model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    config = Qwen2Config(
        **TINY,
        vocab_size=len(tok),
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def groups(vocab: int, count: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(count):
        samples = []
        for _ in range(4):
            k = int(rng.integers(2, 11))
            samples.append(
                Sample(
                    rng.integers(4, vocab, k).astype("<i4"),
                    rng.uniform(-3, -0.5, k).astype("<f4"),
                    np.zeros(k, "<i4"),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        ids = rng.integers(4, vocab, 6).astype("<i4")
        out.append(Trajectory(f"t{g}", f"p{g}", f"g{g}", "smoke", 0, 0, ids, samples))
    return out


def config(model_dir: Path, strategy: str, packing: bool, dtype: str, device: torch.device):
    trainer = {"token_budget": 64} if packing else {"micro_batch_size": 4}
    return config_from_dict(
        {
            "model": {"path": str(model_dir), "dtype": dtype},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 10},
            "trainer": {
                **trainer,
                "strategy": "fsdp" if strategy == "fsdp" else "ddp",
                "device": device.type,
                "rollout_batch_size": GROUPS,
                "ppo_mini_batches": 2,
                "ppo_epochs": 2,
                "logprob_chunk": 16,
                "actor_lr": 1e-3,
                "gradient_checkpointing": False,
            },
        }
    )


def build(cfg, strategy: str, dist: Dist):
    """The policy as `rollctl start-learner` builds it (one rank in a group: wrapped here, as
    learner/process/dist.py `wrap_model` wraps several) and its AdamW."""
    model, _ = load_policy(cfg, dist if dist.world_size > 1 else Dist(device=dist.device))
    if dist.world_size == 1 and strategy == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    elif dist.world_size == 1 and strategy == "fsdp":
        model = shard(model, cfg.model.dtype)
    return model, adamw(model.parameters(), cfg.trainer.actor_lr, cfg.trainer.weight_decay)


def share(data: list[Trajectory], dist: Dist) -> list[Trajectory]:
    quotas = split_quotas([len(data)] * dist.world_size, len(data))
    start = sum(quotas[: dist.rank])
    return data[start : start + quotas[dist.rank]]


def tied(model: torch.nn.Module) -> bool:
    inner = getattr(model, "module", model)
    return inner.get_output_embeddings().weight is inner.get_input_embeddings().weight


def masters_fp32(model: torch.nn.Module, device: torch.device) -> bool:
    return all(
        p.dtype == torch.float32 and p.device.type == device.type and p.grad is not None
        and p.grad.dtype == torch.float32 for p in model.parameters()
    )  # fmt: skip


def publish_reload(model, model_dir: Path, work: Path, dist: Dist) -> bool | None:
    """Publish in bf16, reload the verified bytes, compare greedy continuations (rank 0)."""
    from transformers import AutoModelForCausalLM

    from rollflash.broker.weights.weight_chain import verified_tensors

    weights = full_state_dict(model, torch.bfloat16)  # collective with FSDP
    if not dist.is_main:
        return None
    store = WeightStore(work / "store")
    version = len(store.versions()) + 1
    store.publish(weights, version=version, step=version)
    outs = []
    for state in (verified_tensors(store, version), weights):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        m.load_state_dict(state, strict=False)
        prompt = torch.randint(
            4, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0)
        )
        outs.append(m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               do_sample=False, max_new_tokens=6, pad_token_id=0))  # fmt: skip
    return bool(torch.equal(outs[0], outs[1]))


def run_case(model_dir, strategy, packing, dist, work: Path) -> dict:
    """Two steps with a DCP checkpoint after the first, then a resume from it."""
    cfg = config(model_dir, strategy, packing, "bfloat16", dist.device)
    data = groups(cfg_vocab(model_dir), GROUPS * STEPS)
    steps = [share(data[i * GROUPS : (i + 1) * GROUPS], dist) for i in range(STEPS)]
    model, opt = build(cfg, strategy, dist)
    stats = [train_step(model, opt, steps[0], cfg, AlgoModels(), dist)]
    ckpt = work / f"ckpt-{strategy}-{packing}"
    save_dcp(Trainables(model, opt), ckpt)
    stats.append(train_step(model, opt, steps[1], cfg, AlgoModels(), dist))
    uninterrupted = full_state_dict(model)
    model2, opt2 = build(cfg, strategy, dist)
    load_dcp(Trainables(model2, opt2), ckpt)
    train_step(model2, opt2, steps[1], cfg, AlgoModels(), dist)
    resumed = full_state_dict(model2)
    diff = max((float((resumed[k] - w).abs().max()) for k, w in uninterrupted.items()), default=0)
    return {
        "masters_fp32": all(dist.gather(masters_fp32(model, dist.device))),
        "loss_finite": all(bool(np.isfinite(s["loss/policy"])) for s in stats),
        "updates": [s["optim/updates"] for s in stats],
        "tied": all(dist.gather(tied(model) and tied(model2))),
        "resume_max_diff": diff,
        "published_greedy_match": publish_reload(model, model_dir, work, dist),
    }


def cfg_vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def vs_one_rank(model_dir, strategy: str, dist: Dist) -> float | None:
    """float32 training of the ranks' shares vs one rank (rank 0, in this process) on all."""
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("highest")  # TF32 would differ by ~1e-3
    cfg = config(model_dir, strategy, False, "float32", dist.device)
    data = groups(cfg_vocab(model_dir), GROUPS * STEPS, seed=1)
    model, opt = build(cfg, strategy, dist)
    for i in range(STEPS):
        train_step(
            model, opt, share(data[i * GROUPS : (i + 1) * GROUPS], dist), cfg, AlgoModels(), dist
        )
    weights = full_state_dict(model)
    if not dist.is_main:
        return None
    one = Dist(device=dist.device)
    ref, ref_opt = build(cfg, "single", one)
    for i in range(STEPS):
        train_step(ref, ref_opt, data[i * GROUPS : (i + 1) * GROUPS], cfg, AlgoModels(), one)
    ref_weights = full_state_dict(ref)
    return max(float((ref_weights[k] - w).abs().max()) for k, w in weights.items())


def logprob_checks(model_dir: Path, device: torch.device, dist: Dist) -> dict[str, float]:
    """bf16 on the device vs float32 on CPU, and packed vs padded (float32)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, base.config.vocab_size, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    sel = mask[:, 1:].bool()
    with torch.no_grad():
        ref, _ = token_logprobs(base, ids, mask, 1.0)
        dev = copy.deepcopy(base).to(device)
        with compute_context(dev, dist, "bfloat16"):
            low, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0, chunk=8)
        packed, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0, packed=True)
        padded, _ = token_logprobs(dev, ids.to(device), mask.to(device), 1.0)
    return {
        "bf16_vs_cpu_fp32": float((low.cpu() - ref)[sel].abs().max()),
        "packed_vs_padded": float((packed - padded)[sel.to(device)].abs().max()),
    }


def stall(model_dir: Path, dist: Dist) -> dict:
    """Rank 1 stops itself (SIGSTOP); rank 0's training step must end with the timeout's error."""
    cfg = config(model_dir, "ddp", False, "bfloat16", dist.device)
    model, opt = build(cfg, "ddp", dist)
    dist.barrier()
    if dist.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        train_step(model, opt, groups(cfg_vocab(model_dir), GROUPS), cfg, AlgoModels(), dist)
        return {"ok": False, "error": "the step finished although rank 1 was stopped"}
    except CollectiveTimeout as e:
        waited = time.monotonic() - started
        ok = dist.timeout_s <= waited < dist.timeout_s + STALL_MARGIN_S and "\n" not in str(e)
        return {"ok": ok, "error": str(e), "waited_s": round(waited, 1)}


def correctness(args, dist: Dist, backend: str, model_dir: Path, work: Path) -> dict:
    report: dict = {"world_size": dist.world_size, "backend": backend, "cases": {}}
    if dist.world_size == 1:
        report.update(logprob_checks(model_dir, dist.device, dist))
    strategies = args.strategies.split(",")
    if (
        "fsdp" in strategies
        and dist.world_size > 1
        and "nccl" not in backend
        and dist.device.type == "cuda"
    ):
        strategies.remove("fsdp")
        report["skipped"] = {"fsdp": "ranks share a GPU: FSDP needs NCCL, one GPU per rank"}
    for strategy in strategies:
        for packing in (False, True):
            name = f"{strategy}{'-packed' if packing else ''}"
            report["cases"][name] = run_case(model_dir, strategy, packing, dist, work)
        if dist.world_size > 1:
            report["cases"][strategy]["vs_one_rank_max_diff"] = vs_one_rank(
                model_dir, strategy, dist
            )
    report["ok"] = ok(report, dist.world_size)
    return report


def ok(report: dict, world: int) -> bool:
    cases = report["cases"].values()
    good = all(
        c["masters_fp32"] and c["loss_finite"] and c["tied"] and c["updates"] == [4.0] * STEPS
        and c["published_greedy_match"] and c["resume_max_diff"] <= RESUME_TOL for c in cases
    )  # fmt: skip
    if world == 1:
        return (
            good
            and report["bf16_vs_cpu_fp32"] <= LOGP_TOL
            and report["packed_vs_padded"] <= PACK_TOL
        )
    return good and all(c.get("vs_one_rank_max_diff", 0) <= RANKS_TOL for c in cases)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--strategies", default=None, help="comma-separated subset of single,ddp,fsdp")
    p.add_argument("--stall", type=float, default=0.0, help="> 0: the stall check, this timeout")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU; use --device cpu")
    dist, backend = join(args.device, args.stall or 600.0)
    world = dist.world_size
    args.strategies = args.strategies or ("single,ddp,fsdp" if world == 1 else "ddp,fsdp")
    work = Path(tempfile.gettempdir()) / f"rollflash-gpu-smoke-{os.environ['MASTER_PORT']}"
    if dist.is_main:
        work.mkdir(parents=True, exist_ok=True)
        save_model(work / "model")
    dist.barrier()
    torch.manual_seed(0)
    if args.stall:
        report = stall(work / "model", dist)
    else:
        report = correctness(args, dist, backend, work / "model", work)
        report.update(device=str(dist.device), torch=torch.__version__)
    passed = report["ok"] or not dist.is_main  # rank 0 holds the results that count
    if dist.is_main:
        print(json.dumps(report), flush=True)
    if args.stall:
        os._exit(0 if passed else 1)  # the stopped rank cannot join a teardown
    dist.close()
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
