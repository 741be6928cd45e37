"""One learner step on one collected batch: M x E optimiser updates of the policy (and critic).

    spec = StepSpec.of(cfg)                        # what the step reads, typed, once
    kept, dropped = filter_groups(groups)          # DAPO filters: only groups past collect's cap
    batch = prepare_batch(kept)                    # the StepBatch on the device: scores, reference
                                                   # KL, old values, advantages, proximal
                                                   # log-probs; M mini-batches of its rows
    for epoch in range(ppo_epochs):                # E
        for mini_batch in batch.mini_batches:      # M = trainer.ppo_mini_batches
            policy: policy_loss of each micro-batch, accumulated, one optimiser step
            critic: critic_loss likewise                              (critic: true)

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

With several ranks (learner/process/dist.py) the shares are of the mini-batch's total over all ranks, and
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
groups (learner/step/global_stats.py), so N ranks prepare exactly the advantages one rank would;
group-level estimators (GRPO, RLOO, ...) need no other rank.

Dropout is off in the policy and the critic (set to 0 when they are built: learner/models/dropout.py,
LoRA's adapter dropout included), so the proximal pass and every update compute the same
log-probs from the same weights: the first update's ratio is exactly 1 and a ratio moves only
with the weights, never with a dropout mask. The passes run in train mode, which transformers'
gradient checkpointing needs.

Every log-prob pass (proximal, update, reference) goes through one LogprobSpec
(learner/step/logprobs.py); the losses (learner/step/losses.py) read a LossSpec, and the rest of the step
the StepSpec it belongs to (learner/step/step_spec.py), built once per step.

The step's metrics are reduced by learner/metrics/metric_sums.py in one way over micro-batches, updates
and ranks (a token mean weighted by tokens, a loss by its denominator, maxima, counts), so N
ranks return what one rank returns on the same data; `train_step` returns them over every rank.

Precision (learner/process/device.py): parameters and optimiser state are float32; with `model.dtype:
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

from rollflash.broker.config.config import Config
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.metrics.metric_sums import MetricSums, merged, micro_batch_weights
from rollflash.learner.process.dist import Dist, compute_context, is_sharded
from rollflash.learner.step.batch import MicroBatch, dummy_input
from rollflash.learner.step.filters import filter_groups
from rollflash.learner.step.losses import critic_loss, policy_loss
from rollflash.learner.step.prepare import AlgoModels, prepare_batch
from rollflash.learner.step.step_spec import StepSpec

log = logging.getLogger(__name__)


def _sizes(batch: list[MicroBatch]) -> list[tuple[int, int]]:
    """Each micro-batch's (selected tokens, non-empty rows), read from the device at once."""
    if not batch:
        return []
    counts = torch.stack(
        [torch.stack([mb.mask.sum(), mb.mask.any(dim=-1).sum()]) for mb in batch]
    ).tolist()
    return [(int(t), int(r)) for t, r in counts]


def _denominator(tokens: int, rows: int, agg_mode: str) -> int:
    """A micro-batch's part of the loss denominator: its tokens (token-mean) or non-empty rows."""
    return tokens if agg_mode == "token-mean" else rows


def _shares(denominators: list[int], dist: Dist) -> list[float]:
    total = max(dist.sum(sum(denominators)), 1)
    return [d / total for d in denominators]


def loss_shares(batch: list[MicroBatch], agg_mode: str, dist: Dist = Dist()) -> list[float]:
    """Each micro-batch's share of the step's loss denominator over all ranks (the shares of all
    ranks sum to 1 unless everything is empty)."""
    return _shares([_denominator(t, r, agg_mode) for t, r in _sizes(batch)], dist)


def _backward(
    model: torch.nn.Module,
    batch: list[MicroBatch],
    spec: StepSpec,
    dist: Dist,
    loss_fn: Callable[[MicroBatch], tuple[torch.Tensor, dict]],
    dummy_loss: Callable[[], torch.Tensor],
) -> MetricSums:
    """Backward every micro-batch's share-weighted loss; its metrics weighted by its tokens,
    those AGGREGATED by `loss_agg_mode` by its part of the loss denominator. DDP synchronises
    gradients in the last pass only, so a rank without data runs one zero-weighted pass; FSDP
    gathers parameters in every pass, so all ranks run as many passes as the busiest one, and
    reduce-scatters the gradients in every pass (`sync_every_pass`) or in the last."""
    sums, sizes = MetricSums(), _sizes(batch)
    denominators = [_denominator(t, r, spec.loss.policy.agg_mode) for t, r in sizes]
    shares = _shares(denominators, dist)
    sharded = is_sharded(model)
    passes = max(dist.gather(len(batch))) if sharded else max(len(batch), 1)
    for i in range(passes):
        last = i == passes - 1
        if sharded:
            cast("FSDPModule", model).set_requires_gradient_sync(last or spec.sync_every_pass)
        ddp = isinstance(model, DistributedDataParallel) and not last
        with cast(DistributedDataParallel, model).no_sync() if ddp else nullcontext():
            with compute_context(model, dist, spec.model_dtype):
                loss, metrics = loss_fn(batch[i]) if i < len(batch) else (dummy_loss() * 0.0, {})
            if i >= len(batch):
                loss.backward()
                continue
            (loss * shares[i] * dist.world_size).backward()
        sums.add(metrics, micro_batch_weights(sizes[i][0], denominators[i]))
    return sums


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
    spec: StepSpec,
    dist: Dist = Dist(),
) -> MetricSums:
    """One optimiser update of the policy on a mini-batch; its metrics as sums (an update's
    grad norm weighs 1; a skipped update is counted on rank 0, every rank skips it)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = _backward(
        model,
        batch,
        spec,
        dist,
        lambda mb: policy_loss(model, mb, spec.loss),
        lambda: model(*dummy_input(dist.device)).logits.sum(),
    )
    grad_norm, stepped = _clip_and_step(model.parameters(), optimizer, spec.max_grad_norm)
    skipped = float(not stepped and dist.is_main)
    return sums.add({"optim/grad_norm": grad_norm, "optim/nonfinite_skipped": skipped})


def critic_update(
    models: AlgoModels, batch: list[MicroBatch], spec: StepSpec, dist: Dist = Dist()
) -> MetricSums:
    """One AdamW step of the critic on the clipped value loss against the GAE returns."""
    critic, optimizer = models.critic, models.critic_optimizer
    # a critic algorithm builds both (learner/step/prepare.py)
    assert critic is not None and optimizer is not None
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    sums = _backward(
        critic,
        batch,
        spec,
        dist,
        lambda mb: critic_loss(critic, mb, spec.loss),
        lambda: critic(*dummy_input(dist.device)).sum(),
    )
    grad_norm, stepped = _clip_and_step(
        critic.parameters(), optimizer, spec.max_grad_norm, "critic"
    )
    skipped = float(not stepped and dist.is_main)
    return sums.add({"critic/grad_norm": grad_norm, "critic/nonfinite_skipped": skipped})


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Trajectory],
    cfg: Config,
    models: AlgoModels,
    dist: Dist = Dist(),
    version: int | None = None,
) -> dict[str, float]:
    """Update the policy (and critic) on this rank's share of the step's groups: M x E
    optimiser updates (`version`: the learner's at the step's start, for the per-generator
    mismatch, learner/metrics/mismatch.py). Returns the step's flat metrics over every rank
    (the same on each): reduced over micro-batches, updates and ranks by
    learner/metrics/metric_sums.py, with `optim/updates` and the updates skipped as not finite
    counted.

    Groups the DAPO filters reject are left out here too: collect replaces them up to its cap of
    4 x B per step, and any kept past that cap are dropped here. If no rank has anything left the
    step makes no update and reports `optim/skipped` = 1; a mini-batch that is empty on every rank
    (fewer groups kept than mini-batches) is skipped.
    """
    spec = StepSpec.of(cfg)
    kept, dropped = filter_groups(groups, spec.scores)
    step = MetricSums().add({"filter/dropped_in_step": len(dropped)})
    if dist.sum(len(kept)) == 0:
        step.add({"optim/skipped": 1.0, "loss/policy": 0.0, "optim/grad_norm": 0.0})
        return over_ranks(step, dist)
    policy = getattr(model, "module", model) if spec.updates > 1 else None
    # collective: every rank, even with none
    prepared = prepare_batch(kept, spec, models, dist, policy, version)
    step.add({**prepared.metrics, "optim/skipped": 0.0})  # the same on every rank
    minis = prepared.mini_batches
    if len(minis) > 1:  # every rank skips the mini-batches that are empty on all of them
        minis = [m for m, n in zip(minis, dist.sums([len(m) for m in minis])) if n > 0]
    updates = 0
    for _ in range(spec.epochs):
        for mini in minis:
            step.merge(policy_update(model, optimizer, mini, spec, dist))
            if models.critic is not None:
                step.merge(critic_update(models, mini, spec, dist))
            updates += 1
    step.add({"optim/updates": float(updates if dist.is_main else 0)})
    return over_ranks(step, dist)


def over_ranks(sums: MetricSums, dist: Dist) -> dict[str, float]:
    """This rank's sums combined with every other rank's (collective): the step's values."""
    host = sums.to_host()
    parts = dist.gather([host.sums, host.weights])
    return merged([MetricSums(s, w) for s, w in parts]).values()
