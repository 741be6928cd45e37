"""From a step's groups to micro-batches that carry advantages (and KL / critic inputs).

    scores [G, n] = clip(reward + soft overlong penalty)                 learner/filters.py
    scores        = REWARD_NORMS[reward_norm](scores)                    algos/rewards.py
    ref_logp      = reference model, before the update      (kl_coef > 0)
    old_values    = critic, before its update               (critic: true)
    token_rewards = -kl_coef * KL_t(behaviour || reference)  (use_kl_in_reward)
    adv, returns  = ADVANTAGE_ESTIMATORS[adv_estimator](...) over the group-major batch
    adv           = whiten(adv)                             (whiten_advantages)

The estimators need whole groups, so everything above runs on one group-major padded batch on the
host; the micro-batches are length-sorted slices of it (learner/batch.py), copied to the rank's
device. Batch statistics (reward_norm batch / running, whitening, the metrics) are over every
rank's groups (learner/global_stats.py), so every rank calls `prepare_batch`, with no groups if it
has none this step. `AlgoModels` holds what the chosen
algorithm needs beside the policy, built once per learner process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollflash.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    RunningRewardNorm,
    kl_penalty,
    kl_reward_penalty,
)
from rollflash.broker.config import Config
from rollflash.broker.model_dir import model_directory
from rollflash.broker.schema import Trajectory
from rollflash.learner.batch import (
    MicroBatch,
    dummy_input,
    length_sorted_chunks,
    pad_groups,
    put,
    take,
    turn_inputs,
)
from rollflash.learner.critic import Critic, build_critic
from rollflash.learner.device import batch_to_device
from rollflash.learner.dist import Dist, compute_context, is_sharded
from rollflash.learner.filters import group_scores, truncated
from rollflash.learner.global_stats import global_mean, normalize_scores, whiten
from rollflash.learner.packing import budget_chunks
from rollflash.learner.reference import AdaptersOffReference, ReferencePolicy

# estimators that whiten their returns over the batch (REINFORCE++'s global normalisation)
WHITENED_ESTIMATORS = ("reinforce++", "reinforce++-baseline")


@dataclass
class AlgoModels:
    """What the algorithm needs beside the policy and its optimiser."""

    reference: ReferencePolicy | None = None  # frozen initial policy, when kl_coef > 0
    critic: Critic | None = None  # value model, when algo.critic
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_norm: RunningRewardNorm = field(
        default_factory=RunningRewardNorm
    )  # reward_norm: running


def build_algo_models(
    cfg: Config, dist: Dist = Dist(), policy: torch.nn.Module | None = None
) -> AlgoModels:
    """Load the reference and build the critic only when the config uses them, on this rank's
    device, sharded with `strategy: fsdp` as the policy is; with LoRA the reference is `policy`
    (the peft model) with its adapters off."""
    models = AlgoModels()
    fsdp = cfg.trainer.strategy == "fsdp"
    if cfg.algo.kl_coef > 0 and cfg.model.lora is not None:
        models.reference = AdaptersOffReference(policy)
    elif cfg.algo.kl_coef > 0:
        models.reference = ReferencePolicy.load(
            model_directory(cfg.model.path),
            cfg.model.dtype,
            dist,
            fsdp,
            cfg.model.attn_implementation,
            cfg.model.trust_remote_code,
        )
    if cfg.algo.critic:
        models.critic, models.critic_optimizer = build_critic(cfg, dist)
    return models


@dataclass
class PreparedBatch:
    micro_batches: list[MicroBatch]
    metrics: dict[str, float]  # reward shaping, advantage and reference-KL statistics


@torch.no_grad()
def _model_inputs(
    full: MicroBatch, chunks: list[torch.Tensor], cfg: Config, models: AlgoModels, dist: Dist
) -> None:
    """Fill full.ref_logp and full.old_values ([B, L-1] float32, on the host), one micro-batch
    at a time on the device. Sharded models gather their parameters in every forward pass, so
    every rank then runs as many passes as the busiest one (the extra ones on a dummy row)."""
    ref, critic = models.reference, models.critic
    if ref is not None:
        full.ref_logp = torch.zeros_like(full.behav_logp)
    if critic is not None:
        full.old_values = torch.zeros_like(full.behav_logp)
        critic.eval()
    sharded = (ref is not None and is_sharded(ref.model)) or (
        critic is not None and is_sharded(critic)
    )
    passes = max(dist.gather(len(chunks))) if sharded else len(chunks)
    packed = cfg.trainer.token_budget > 0
    with compute_context(critic, dist, cfg.model.dtype):
        for i in range(passes):
            if i >= len(chunks):
                ids, attn = dummy_input(dist.device)
                mb = MicroBatch(ids, attn, *[torch.zeros(1, 1, device=dist.device)] * 3)
            else:
                mb = batch_to_device(take(full, chunks[i]), dist.device)
            if ref is not None:
                logp = ref.logprobs(mb, cfg.rollout.temperature, packed, cfg.trainer.logprob_chunk)
                if i < len(chunks):
                    put(full.ref_logp, chunks[i], logp.cpu())
            if critic is not None:
                values = critic(mb.input_ids, mb.attention_mask, packed)
                if i < len(chunks):
                    put(full.old_values, chunks[i], values.float().cpu())


def _advantages(
    full: MicroBatch,
    scores: torch.Tensor,
    cfg: Config,
    models: AlgoModels,
    groups: list[Trajectory],
    dist: Dist,
) -> dict[str, float]:
    """Set full.advantages (and full.returns with a critic) from group-major scores [G, n]."""
    a = cfg.algo
    normed = normalize_scores(scores, a.reward_norm, models.reward_norm, dist)  # [G, n]
    token_rewards, metrics = None, {}
    if full.ref_logp is not None:
        kl = kl_penalty(full.behav_logp, full.ref_logp, a.kl_estimator, mask=full.mask)
        metrics["kl/behav_ref_kl"] = global_mean(kl, full.mask, dist)
        if a.use_kl_in_reward:
            token_rewards = kl_reward_penalty(
                full.behav_logp, full.ref_logp, full.mask, a.kl_coef, a.kl_estimator
            )
    adv = returns = torch.zeros_like(full.behav_logp)
    if groups:  # a rank without groups still takes part in the collectives
        inputs = AdvantageInputs(
            scores=normed.reshape(-1),
            mask=full.mask,
            group_size=scores.shape[1],
            values=full.old_values,
            token_rewards=token_rewards,
            turns=turn_inputs(groups, full.mask),
        )
        out = ADVANTAGE_ESTIMATORS[a.adv_estimator](
            inputs, AdvantageConfig(gamma=a.gamma, lam=a.lam)
        )
        adv, returns = out.advantages, out.returns
    if a.adv_estimator in WHITENED_ESTIMATORS and dist.world_size > 1:
        # their whitening over the batch is over every rank's tokens, as on one rank
        adv = whiten(returns, full.mask, dist, eps=AdvantageConfig().eps)
    full.advantages = whiten(adv, full.mask, dist) if a.whiten_advantages else adv
    if models.critic is not None:
        full.returns = returns
    return {
        **metrics,
        "advantage/mean": global_mean(full.advantages, full.mask, dist),
        "advantage/abs_mean": global_mean(full.advantages.abs(), full.mask, dist),
    }


def prepare_batch(
    groups: list[Trajectory], cfg: Config, models: AlgoModels, dist: Dist = Dist()
) -> PreparedBatch:
    """Micro-batches for the groups (all of size n) on `dist.device`: at most
    `trainer.micro_batch_size` sequences, or with `trainer.token_budget` at most that many
    tokens, packed (learner/packing.py). Collective with several ranks: every rank calls it."""
    n = cfg.rollout.num_return_sequences
    scores = torch.stack([group_scores(g, cfg) for g in groups]) if groups else torch.zeros(0, n)
    cut = torch.cat([truncated(g) for g in groups]) if groups else torch.zeros(0, dtype=torch.bool)
    full = pad_groups(groups, keep=~cut if cfg.algo.overlong_filter else None)
    chunks = (
        budget_chunks(full.lengths, cfg.trainer.token_budget)
        if cfg.trainer.token_budget
        else length_sorted_chunks(full, cfg.trainer.micro_batch_size)
    )
    _model_inputs(full, chunks, cfg, models, dist)
    metrics = _advantages(full, scores, cfg, models, groups, dist)
    raw = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    every = torch.ones(raw.shape, dtype=torch.bool)
    score_mean = global_mean(scores.reshape(-1), every, dist)
    metrics.update(
        {
            "reward/score_mean": score_mean,
            "reward/shaping_mean": score_mean - global_mean(raw, every, dist),
            "response/truncated_frac": global_mean(cut.float(), every, dist),
        }
    )
    micro = [batch_to_device(take(full, rows), dist.device) for rows in chunks]
    return PreparedBatch(micro, metrics)
