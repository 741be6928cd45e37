"""One learner step on one collected batch: M x E optimiser updates of the policy (and critic).

    kept, dropped = filter_groups(groups)          # DAPO filters: only groups past collect's cap
    batch = prepare_batch(kept)                    # scores, reference KL, old values, advantages,
                                                   # proximal log-probs; M mini-batches
    for epoch in range(ppo_epochs):                # E
        for mini_batch in batch.mini_batches:      # M = trainer.ppo_mini_batches
            policy: loss = POLICY_LOSSES[policy_loss] + kl_coef * kl_loss + entropy_coef * bonus
            critic: loss = value_loss(values, old_values, returns)      (critic: true)

The proximal policy of decoupled PPO (Hilton et al. 2022) is the learner's own policy at the start
of the step: the trust-region centre of every update of the step, and the numerator of the
off-policy weight pi_prox / pi_behaviour that `algos` bounds per `algo.is_mode` / `is_level` /
`tis_cap`. With M x E > 1 its log-probs are computed once, in a no-grad forward pass before the
first update (prepare_batch); the first mini-batch's ratio is then exactly 1 and later updates'
ratios move away from it, which is where `clip_low` / `clip_high`, `dual_clip_c` and the critic's
`clip_range_value` bind. With M = E = 1 the step's one update starts at the proximal policy, so
its detached log-probs serve and the extra pass is skipped: the ratio is 1 and no clip binds.

One weight version is published per learner step whatever M and E are, so staleness keeps
counting learner steps; the lr schedule counts learner steps too (every update of a step uses the
step's learning rate).

Gradient accumulation keeps the chosen aggregation exact within each update: each micro-batch's
loss (policy, KL, entropy and value alike, all aggregated by `loss_agg_mode`) is weighted by its
share of the mini-batch's selected tokens (token-mean) or of its non-empty sequences (the
seq-mean modes).

With several ranks (learner/dist.py) the shares are of the mini-batch's total over all ranks, and
each rank's loss is multiplied by the world size because DDP and FSDP average gradients: the
summed gradient is then exactly the one-rank gradient of the whole mini-batch. DDP synchronises
gradients once per update, on a rank's last micro-batch. FSDP reduce-scatters them after every
micro-batch (`trainer.fsdp_reduce_scatter: every_micro_batch`), so a rank only ever holds its
shard of the gradient (4 bytes a parameter / N); `last_micro_batch` reduce-scatters once per
update, at the cost of a full unsharded float32 gradient on every rank in between (+4 bytes a
parameter). A rank with less data runs zero-weighted passes so that it still takes part in the
collectives.

A gradient whose norm is not finite (inf or NaN: an overflow, a poisoned batch) is not stepped
on: the update is skipped on every rank, its gradient dropped, and it is counted
(`optim/nonfinite_skipped`, the step's skipped updates) and logged. The norm is over the whole
model on every rank (DDP's gradients are all-reduced, FSDP's norm is a full DTensor), so the
ranks agree. Batch-level statistics
(`reward_norm: batch` and `running`, `whiten_advantages`, the batch metrics) are over every rank's
groups (learner/global_stats.py), so N ranks prepare exactly the advantages one rank would;
group-level estimators (GRPO, RLOO, ...) need no other rank.

Entropy of the sampled positions (`policy/entropy`) is always logged, from the logits the update
computes anyway; it takes part in the gradient only with `algo.entropy_coef` > 0.

Precision (learner/device.py): parameters and optimiser state are float32; with `model.dtype:
bfloat16` forward passes run under bf16 autocast (one rank, DDP) or FSDP2's MixedPrecisionPolicy,
and the backward pass follows the forward's dtypes. Log-probs are float32 for the ratio."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, cast

import torch
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

from rollflash.algos import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    entropy_bonus,
    kl_loss,
    value_loss,
)
from rollflash.broker.config import Config
from rollflash.broker.schema import Trajectory
from rollflash.learner.batch import MicroBatch, dummy_input
from rollflash.learner.device import DTYPES
from rollflash.learner.dist import Dist, compute_context, is_sharded
from rollflash.learner.filters import filter_groups
from rollflash.learner.logprobs import token_logprobs
from rollflash.learner.prepare import AlgoModels, prepare_batch

log = logging.getLogger(__name__)


def norm_len(cfg: Config) -> float:
    """The constant divisor of seq-mean-token-sum-norm: algo.norm_len, else the generation budget."""
    return cfg.algo.norm_len or float(cfg.rollout.max_new_tokens)


def loss_config(cfg: Config) -> PolicyLossConfig:
    a = cfg.algo
    return PolicyLossConfig(
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip_c=a.dual_clip_c,
        tis_cap=a.tis_cap,
        agg_mode=a.loss_agg_mode,
        is_mode=a.is_mode,
        is_level=a.is_level,
        is_low=a.is_low,
        norm_len=norm_len(cfg),
    )


class _MetricMeans:
    """Accumulates per-micro-batch metrics where they were computed: share-weighted means, and
    maxima for `*_max` names. Ratios of sums (explained variance) become share-weighted means of
    the per-micro-batch ratios. Nothing is read back until `values`, which copies every metric to
    the host in one transfer: one device sync per step instead of one per metric per pass."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weight = 0.0

    def add(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        self.weight += weight
        for name, value in metrics.items():
            v = torch.as_tensor(value).detach().float().reshape(())
            prev = self.sums.get(name)
            if name.endswith("_max"):
                self.sums[name] = v if prev is None else torch.maximum(prev, v.to(prev.device))
            else:
                self.sums[name] = weight * v if prev is None else prev + weight * v.to(prev.device)

    @property
    def values(self) -> dict[str, float]:
        if not self.sums:
            return {}
        names, w = list(self.sums), self.weight or 1.0
        device = self.sums[names[0]].device
        host = torch.stack([self.sums[k].to(device) for k in names]).tolist()
        return {k: v if k.endswith("_max") else v / w for k, v in zip(names, host)}


def loss_shares(batch: list[MicroBatch], agg_mode: str, dist: Dist = Dist()) -> list[float]:
    """Each micro-batch's share of the step's loss denominator over all ranks (the shares of all
    ranks sum to 1 unless everything is empty)."""
    sizes = [mb.num_tokens if agg_mode == "token-mean" else mb.num_seqs for mb in batch]
    total = max(dist.sum(sum(sizes)), 1)
    return [s / total for s in sizes]


def _backward(
    model: torch.nn.Module,
    batch: list[MicroBatch],
    shares: list[float],
    dist: Dist,
    loss_fn: Callable[[MicroBatch], tuple[torch.Tensor, dict]],
    dummy_loss: Callable[[], torch.Tensor],
    model_dtype: str = "float32",
    sync_every_pass: bool = True,
) -> _MetricMeans:
    """Backward every micro-batch's share-weighted loss. DDP synchronises gradients in the last
    pass only, so a rank without data runs one zero-weighted pass; FSDP gathers parameters in
    every pass, so all ranks run as many passes as the busiest one, and reduce-scatters the
    gradients in every pass (`sync_every_pass`) or in the last."""
    means = _MetricMeans()
    sharded = is_sharded(model)
    passes = max(dist.gather(len(batch))) if sharded else max(len(batch), 1)
    for i in range(passes):
        last = i == passes - 1
        if sharded:
            cast("FSDPModule", model).set_requires_gradient_sync(last or sync_every_pass)
        ddp = isinstance(model, DistributedDataParallel) and not last
        with cast(DistributedDataParallel, model).no_sync() if ddp else nullcontext():
            with compute_context(model, dist, model_dtype):
                loss, metrics = loss_fn(batch[i]) if i < len(batch) else (dummy_loss() * 0.0, {})
            if i >= len(batch):
                loss.backward()
                continue
            (loss * shares[i] * dist.world_size).backward()
        means.add(metrics, shares[i])
    return means


def mismatch_metrics(
    logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train-inference mismatch between the learner's and the generator's log-probabilities."""
    d = (logp.detach() - behav)[mask]
    if d.numel() == 0:
        zero = torch.zeros((), device=logp.device)
        return {"mismatch/abs_dlogp_mean": zero, "mismatch/kl": zero, "mismatch/ratio_max": zero}
    return {
        "mismatch/abs_dlogp_mean": d.abs().mean(),
        "mismatch/kl": (torch.exp(-d) - 1 + d).mean(),  # k3 estimate of KL(behaviour || learner)
        "mismatch/ratio_max": torch.exp(d).max(),
    }


def policy_loss(
    model: torch.nn.Module, mb: MicroBatch, cfg: Config
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's total policy loss (differentiable) and its metrics, `loss/*` included."""
    a = cfg.algo
    logp, entropy = token_logprobs(
        model,
        mb.input_ids,
        mb.attention_mask,
        cfg.rollout.temperature,
        with_entropy=True,
        packed=cfg.trainer.token_budget > 0,
        chunk=cfg.trainer.logprob_chunk,
        dtype=DTYPES[cfg.trainer.logprob_dtype],
        entropy_grad=a.entropy_coef > 0,
    )
    out = POLICY_LOSSES[a.policy_loss](
        PolicyLossInputs(
            logp=logp,
            prox_logp=logp.detach() if mb.prox_logp is None else mb.prox_logp,
            behav_logp=mb.behav_logp,
            advantages=mb.advantages,
            mask=mb.mask,
        ),
        loss_config(cfg),
    )
    total = out.loss
    metrics = {
        **out.metrics,
        # against the policy before the step's updates: the version the samples are tagged with
        **mismatch_metrics(logp if mb.prox_logp is None else mb.prox_logp, mb.behav_logp, mb.mask),
        "loss/policy": out.loss.detach(),
    }
    if mb.ref_logp is not None and not a.use_kl_in_reward:
        kl = kl_loss(
            logp,
            mb.ref_logp,
            mb.mask,
            a.kl_estimator,
            agg_mode=a.loss_agg_mode,
            norm_len=norm_len(cfg),
        )
        total = total + a.kl_coef * kl.loss
        metrics.update(kl.metrics)
        metrics["loss/kl"] = kl.loss.detach()
    if entropy is not None:
        ent = entropy_bonus(entropy, mb.mask, agg_mode=a.loss_agg_mode, norm_len=norm_len(cfg))
        metrics.update(ent.metrics)
        if a.entropy_coef > 0:
            total = total + a.entropy_coef * ent.loss
            metrics["loss/entropy"] = ent.loss.detach()
    metrics["loss/total"] = total.detach()
    return total, metrics


def _clip_and_step(
    params, optimizer: torch.optim.Optimizer, max_grad_norm: float, name: str = "policy"
) -> tuple[float, bool]:
    """Clip the gradient and step; (its norm, whether the step was made). A norm that is not
    finite skips the step and drops the gradient (module docstring)."""
    params = list(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, max_grad_norm if max_grad_norm > 0 else float("inf")
    )
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor (the norm over all shards)
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        log.warning("%s gradient norm is %s: update skipped (optim/nonfinite_skipped)", name, norm)
        return norm, False
    optimizer.step()
    return norm, True


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: list[MicroBatch],
    cfg: Config,
    dist: Dist = Dist(),
) -> dict[str, float]:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    means = _backward(
        model,
        batch,
        loss_shares(batch, cfg.algo.loss_agg_mode, dist),
        dist,
        lambda mb: policy_loss(model, mb, cfg),
        lambda: model(*dummy_input(dist.device)).logits.sum(),
        cfg.model.dtype,
        cfg.trainer.fsdp_reduce_scatter == "every_micro_batch",
    )
    grad_norm, stepped = _clip_and_step(model.parameters(), optimizer, cfg.trainer.max_grad_norm)
    return {
        **means.values,
        "optim/grad_norm": grad_norm,
        "optim/nonfinite_skipped": float(not stepped),
    }


def critic_update(
    models: AlgoModels, batch: list[MicroBatch], cfg: Config, dist: Dist = Dist()
) -> dict[str, float]:
    """One AdamW step of the critic on the clipped value loss against the GAE returns."""
    critic, optimizer, a = models.critic, models.critic_optimizer, cfg.algo
    # a critic algorithm builds both, and its batches carry values and returns (learner/prepare.py)
    assert critic is not None and optimizer is not None
    critic.train()
    optimizer.zero_grad(set_to_none=True)

    def loss_fn(mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        assert mb.old_values is not None and mb.returns is not None
        out = value_loss(
            critic(mb.input_ids, mb.attention_mask, cfg.trainer.token_budget > 0),
            mb.old_values,
            mb.returns,
            mb.mask,
            a.clip_range_value,
            agg_mode=a.loss_agg_mode,
            norm_len=norm_len(cfg),
        )
        return out.loss, {**out.metrics, "loss/value": out.loss.detach()}

    means = _backward(
        critic,
        batch,
        loss_shares(batch, a.loss_agg_mode, dist),
        dist,
        loss_fn,
        lambda: critic(*dummy_input(dist.device)).sum(),
        cfg.model.dtype,
        cfg.trainer.fsdp_reduce_scatter == "every_micro_batch",
    )
    grad_norm, stepped = _clip_and_step(
        critic.parameters(), optimizer, cfg.trainer.max_grad_norm, "critic"
    )
    return {
        **means.values,
        "critic/grad_norm": grad_norm,
        "critic/nonfinite_skipped": float(not stepped),
    }


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Trajectory],
    cfg: Config,
    models: AlgoModels,
    dist: Dist = Dist(),
) -> dict[str, float]:
    """Update the policy (and critic) on this rank's share of the step's groups: M x E
    optimiser updates; returns the rank's flat metrics, each update's metrics averaged over
    the updates (`*_max`: their maximum) and `optim/updates`.

    Groups the DAPO filters reject are left out here too: collect replaces them up to its cap of
    4 x B per step, and any kept past that cap are dropped here. If no rank has anything left the
    step makes no update and reports `optim/skipped` = 1; a mini-batch that is empty on every rank
    (fewer groups kept than mini-batches) is skipped.
    """
    kept, dropped = filter_groups(groups, cfg)
    stats = {"filter/dropped_in_step": float(len(dropped)), "optim/skipped": 0.0}
    if dist.sum(len(kept)) == 0:
        return {**stats, "optim/skipped": 1.0, "loss/policy": 0.0, "optim/grad_norm": 0.0}
    t = cfg.trainer
    policy = getattr(model, "module", model) if t.updates_per_step > 1 else None
    # collective: every rank, even with none
    prepared = prepare_batch(kept, cfg, models, dist, policy)
    stats.update(prepared.metrics)
    minis = prepared.mini_batches
    if len(minis) > 1:  # every rank skips the mini-batches that are empty on all of them
        minis = [m for m, n in zip(minis, dist.sums([len(m) for m in minis])) if n > 0]
    updates = []
    for _ in range(t.ppo_epochs):
        for mini in minis:
            update = policy_update(model, optimizer, mini, cfg, dist)
            if models.critic is not None:
                update.update(critic_update(models, mini, cfg, dist))
            updates.append(update)
    skipped: dict[str, float] = {  # counts over the step's updates, not means
        k: sum(u[k] for u in updates) for k in ("optim/nonfinite_skipped", "critic/nonfinite_skipped")
        if k in updates[0]
    }  # fmt: skip
    return {
        **stats,
        **mean_over_updates(updates),
        **skipped,
        "optim/updates": float(len(updates)),
    }


def mean_over_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the step's updates that report it (`*_max`: the maximum)."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for u in updates for k in u):
        values = [u[name] for u in updates if name in u]
        out[name] = max(values) if name.endswith("_max") else sum(values) / len(values)
    return out
