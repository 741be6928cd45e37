"""Reward-model training (`rollctl train-rm --config rm.yaml`): Bradley-Terry on preference pairs.

    pairs       = load_preferences(rm.dataset)              # JSONL {"prompt", "chosen", "rejected"}
    train, held = split_pairs(pairs, rm.eval_split)         # or rm.eval_dataset
    model       = AutoModelForSequenceClassification(rm.pretrain or model.path, num_labels=1)
    repeat:       loss = bradley_terry_loss(r(chosen), r(rejected))   (algos/preference.py)
    save          a standard Hugging Face directory at rm.save_path (config, tokenizer, weights)

The model is any local Hugging Face model with a scalar head: `*ForSequenceClassification` with one
label, which reads the last non-pad token. Starting from the policy (the default, `model.path`) is
InstructGPT's recipe (their reward model starts from the SFT model); the head starts random.
Inputs are `broker.rm_input.reward_model_input_ids`: prompt + response + EOS, the same ids the
generators score (generators/rewarder.py).

Ranks: run under `torchrun --nproc-per-node N -m rollflash.rollctl.cli train-rm ...` and every rank
takes every N-th pair of each global batch of `rm.train_batch_size` pairs, gradients are averaged by
DistributedDataParallel, held-out counts are summed over ranks, and rank 0 saves. Without torchrun
it is one process. Devices and precision are the learner's (learner/process/device.py): `trainer.device`
picks cuda:LOCAL_RANK when there is a GPU, the group is `cpu:gloo,cuda:nccl` (the held-out counts
are reduced on the CPU), and `model.dtype: bfloat16` trains float32 masters under bf16 autocast.

The learning rate warms up linearly over min(20, steps // 10) steps, then follows a cosine down to
0.1 x `rm.learning_rate` (learner/models/schedule.py). A bad preference file stops before any training
with one line naming the file and line number (learner/tools/preferences.py).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rollflash.algos import bradley_terry_loss
from rollflash.broker.config.config import Config
from rollflash.broker.config.model_dir import model_directory
from rollflash.broker.config.process import setup_process
from rollflash.broker.connect.secrets import make_private_dir
from rollflash.broker.wire.rm_input import reward_model_batch, reward_model_input_ids
from rollflash.errors import BadInput
from rollflash.learner.models.schedule import warmup_decay
from rollflash.learner.process.device import (
    adamw,
    autocast,
    cuda_defaults,
    set_alloc_conf,
    to_device,
)
from rollflash.learner.process.dist import Dist, init_dist
from rollflash.learner.tools.preferences import (
    PreferenceFileError,
    PreferencePair,
    load_preferences,
    split_pairs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_reward_model(
    path: str | Path,
    dtype: str = "float32",
    key: str = "rm.pretrain",
    trust_remote_code: bool = False,
):
    """(model, tokenizer) of a scalar-head model: `AutoModelForSequenceClassification` with one
    label; a causal-LM directory gets a fresh head. Sets pad_token_id (needed for batches).
    `path`: a directory or a cached hub id (broker/config/model_dir.py); `key` names it in errors."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = model_directory(str(path), key)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def indistinguishable(tokenizer: Any, pairs: list[PreferencePair], max_len: int) -> int:
    """Pairs whose two inputs are the same token ids (a tokenizer that drops whitespace, or a
    cut at max_len): no reward model can rank them, they count as wrong in the accuracy."""
    return sum(
        reward_model_input_ids(tokenizer, p.prompt, p.chosen, max_len)
        == reward_model_input_ids(tokenizer, p.prompt, p.rejected, max_len)
        for p in pairs
    )


def encode_texts(
    tokenizer: Any, prompts: list[str], responses: list[str], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [N, L] int64 and attention_mask [N, L] int64 of prompt + response + EOS."""
    ids, mask = reward_model_batch(tokenizer, prompts, responses, max_len, tokenizer.pad_token_id)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def pair_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: list[PreferencePair],
    max_len: int,
    dtype: str = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P]) float32 rewards of P pairs, from one forward pass over 2P rows
    on the model's device; `dtype`: `model.dtype`, the compute dtype (bf16 autocast)."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ids, mask = encode_texts(tokenizer, prompts, responses, max_len)
    device = next(model.parameters()).device
    with autocast(device, dtype):
        out = model(input_ids=to_device(ids, device), attention_mask=to_device(mask, device))
    scores = out.logits[:, 0].float()
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def pairwise_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: list[PreferencePair],
    max_len: int,
    dist: Dist = Dist(),
    batch: int = 128,
) -> dict[str, float]:
    """Share of held-out pairs with r(chosen) > r(rejected) (ties count wrong) and the mean margin,
    summed over ranks (each scores every world_size-th pair)."""
    model.eval()
    mine = pairs[dist.rank :: dist.world_size]
    totals = torch.zeros(3, dtype=torch.float64)  # correct, margin sum, count
    for start in range(0, len(mine), batch):
        chosen, rejected = pair_scores(model, tokenizer, mine[start : start + batch], max_len)
        margin = (chosen - rejected).double().cpu()
        totals += torch.stack(
            [
                (margin > 0).double().sum(),
                margin.sum(),
                torch.tensor(float(margin.numel()), dtype=torch.float64),
            ]
        )
    if dist.world_size > 1:
        torch.distributed.all_reduce(totals)
    correct, margin_sum, count = totals.tolist()
    return {"acc": correct / max(count, 1), "margin": margin_sum / max(count, 1)}


def _wrap(model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """The model on this rank's device, in DistributedDataParallel over the ranks."""
    model = model.to(dist.device)
    if dist.world_size == 1:
        return model
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def lr_schedule(total: int) -> Callable[[int], float]:
    """LambdaLR multiplier (learner/models/schedule.py): linear warm-up over min(20, total // 10) steps
    (at least 1), then cosine from 1 down to 0.1 at `total`."""
    return warmup_decay(max(1, min(20, total // 10)), total, "cosine", floor=0.1)


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    batch: list[PreferencePair],
    cfg: Config,
) -> dict[str, float]:
    """One optimiser step on this rank's share of a global batch (micro-batched, mean loss)."""
    rm = cfg.rm
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for start in range(0, len(batch), rm.micro_train_batch_size):
        micro = batch[start : start + rm.micro_train_batch_size]
        chosen, rejected = pair_scores(model, tokenizer, micro, rm.max_len, cfg.model.dtype)
        out = bradley_terry_loss(chosen, rejected)
        share = len(micro) / len(batch)
        (out.loss * share).backward()
        for name, value in {"rm/loss": out.loss.detach(), **out.metrics}.items():
            sums[name] = sums.get(name, 0.0) + share * float(value)
    params = [p for p in model.parameters() if p.grad is not None]
    clip = rm.max_grad_norm if rm.max_grad_norm > 0 else float("inf")
    sums["rm/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, clip))
    optimizer.step()
    return sums


def _total_steps(train: list[PreferencePair], cfg: Config) -> int:
    """Optimiser steps of the run: rm.max_steps, else rm.max_epochs epochs of whole batches."""
    rm = cfg.rm
    per_epoch = len(train) // rm.train_batch_size
    if per_epoch == 0:
        raise PreferenceFileError(
            f"rm.train_batch_size: {rm.train_batch_size} pairs per step but "
            f"only {len(train)} training pairs"
        )
    return rm.max_steps or per_epoch * rm.max_epochs


def _batches(train: list[PreferencePair], cfg: Config, dist: Dist, total: int):
    """Yield (step, this rank's pairs) for steps 1..total: shuffled epochs (seeded), global batches
    of rm.train_batch_size pairs (the last partial one dropped), rank r takes r::world_size."""
    rm, rng = cfg.rm, random.Random(cfg.run.seed)
    per_epoch = len(train) // rm.train_batch_size
    step = 0
    while step < total:
        order = train[:]
        rng.shuffle(order)
        for i in range(per_epoch):
            if step == total:
                return
            step += 1
            batch = order[i * rm.train_batch_size : (i + 1) * rm.train_batch_size]
            yield step, batch[dist.rank :: dist.world_size]


def _datasets(cfg: Config) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs: rm.eval_dataset, or a split of rm.dataset."""
    rm = cfg.rm
    pairs = load_preferences(rm.dataset)
    if rm.eval_dataset:
        return pairs, load_preferences(rm.eval_dataset)
    return split_pairs(pairs, rm.eval_split)


def _optimise(
    model: torch.nn.Module,
    tokenizer: Any,
    train: list[PreferencePair],
    held: list[PreferencePair],
    cfg: Config,
    dist: Dist,
    sink: Any,
) -> int:
    """Every optimiser step of the run, logged to `sink` (rank 0); returns the number of steps."""
    rm, inner = cfg.rm, getattr(model, "module", model)
    total = _total_steps(train, cfg)
    optimizer = adamw(model.parameters(), rm.learning_rate, rm.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total))
    for step, batch in _batches(train, cfg, dist, total):
        metrics = _train_step(model, optimizer, tokenizer, batch, cfg)
        scheduler.step()
        if rm.eval_every and step % rm.eval_every == 0 and step < total:
            metrics["eval/pairwise_acc"] = pairwise_accuracy(
                inner, tokenizer, held, rm.max_len, dist
            )["acc"]
        if sink is not None:
            sink.log(step, metrics)
        if step % 50 == 0 or step == total:
            log.info(
                "rm step %d/%d loss %.4f acc %.3f",
                step,
                total,
                metrics["rm/loss"],
                metrics["rm/acc"],
            )
    return total


def train_reward_model(cfg: Config, dist: Dist | None = None) -> dict[str, Any]:
    """Train, evaluate and save the reward model described by `cfg.rm`; returns the summary (also
    written to {run_dir}/summary.json and {save_path}/reward_model.json on rank 0). `dist`: the
    ranks (default: join the process group torchrun describes, if any)."""
    from rollflash.learner.metrics.metrics import MetricsSink

    rm, dist = cfg.rm, dist or init_dist(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    if rm.train_batch_size % dist.world_size:
        raise BadInput(
            f"rm.train_batch_size: {rm.train_batch_size} does not split over "
            f"{dist.world_size} ranks"
        )
    started = time.monotonic()
    train, held = _datasets(cfg)
    # float32 master weights; model.dtype is the compute dtype (pair_scores' autocast)
    model, tokenizer = load_reward_model(
        rm.pretrain or cfg.model.path,
        "float32",
        "rm.pretrain" if rm.pretrain else "model.path",
        cfg.model.trust_remote_code,
    )
    same = indistinguishable(tokenizer, train + held, rm.max_len)
    if same:
        log.warning(
            "%d of %d preference pairs are the same token ids for both responses (the "
            "tokenizer drops a difference, or rm.max_len cuts it off)",
            same,
            len(train) + len(held),
        )
    model = _wrap(model, dist)
    inner = getattr(model, "module", model)
    sink = MetricsSink(cfg.run.run_dir, tensorboard=False) if dist.is_main else None
    before = pairwise_accuracy(inner, tokenizer, held, rm.max_len, dist)
    log.info(
        "held-out pairwise accuracy before training: %.3f (%d pairs; %d to train on)",
        before["acc"],
        len(held),
        len(train),
    )
    total = _optimise(model, tokenizer, train, held, cfg, dist, sink)
    after = pairwise_accuracy(inner, tokenizer, held, rm.max_len, dist)
    summary = {
        "train_pairs": len(train),
        "eval_pairs": len(held),
        "steps": total,
        "eval_pairwise_acc_before": round(before["acc"], 4),
        "eval_pairwise_acc": round(after["acc"], 4),
        "eval_margin": round(after["margin"], 4),
        "indistinguishable_pairs": same,
        "world_size": dist.world_size,
        "wall_s": round(time.monotonic() - started, 1),
        "save_path": rm.save_path,
    }
    if sink is not None:
        _save(inner, tokenizer, cfg, summary)
        sink.log(total, {"eval/pairwise_acc": after["acc"], "eval/margin": after["margin"]})
        sink.close()
    return summary


def _save(model: torch.nn.Module, tokenizer: Any, cfg: Config, summary: dict[str, Any]) -> None:
    out = Path(cfg.rm.save_path)
    out.mkdir(parents=True, exist_ok=True)
    cast("PreTrainedModel", model).save_pretrained(out)  # the HF model load_reward_model built
    tokenizer.save_pretrained(out)
    info = {
        **summary,
        "input": "prompt + response + EOS (broker/wire/rm_input.py)",
        "dataset": cfg.rm.dataset,
        "pretrain": cfg.rm.pretrain or cfg.model.path,
    }
    (out / "reward_model.json").write_text(json.dumps(info, indent=1) + "\n")
    run_dir = Path(cfg.run.run_dir)
    make_private_dir(run_dir)
    cfg.save(run_dir / "config.yaml")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def run(cfg: Config) -> dict[str, Any]:
    """Process entry point of `rollctl train-rm`."""
    set_alloc_conf(
        cfg.trainer.cuda_alloc_conf
    )  # the learner's GPU defaults (learner/process/device.py)
    dist = init_dist(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    cuda_defaults(dist.device, cfg.trainer.tf32)
    setup_process(f"rm:{dist.rank}", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    try:
        return train_reward_model(cfg, dist)
    finally:
        dist.close()
