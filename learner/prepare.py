"""From a step's groups to micro-batches that carry advantages (and KL / critic inputs).

    scores [G, n] = clip(reward + soft overlong penalty)                 learner/filters.py
    scores        = REWARD_NORMS[reward_norm](scores)                    algos/rewards.py
    ref_logp      = reference model, before the update      (kl_coef > 0)
    old_values    = critic, before its update               (critic: true)
    token_rewards = -kl_coef * KL_t(behaviour || reference)  (use_kl_in_reward)
    adv, returns  = ADVANTAGE_ESTIMATORS[adv_estimator](...) over the group-major batch
    adv           = whiten(adv)                             (whiten_advantages)

The estimators need whole groups, so everything above runs on one group-major padded batch; the
micro-batches are length-sorted slices of it (learner/batch.py). `AlgoModels` holds what the chosen
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
    masked_mean,
    masked_whiten,
    normalize_rewards,
)
from rollflash.broker.config import Config
from rollflash.broker.schema import Trajectory
from rollflash.learner.batch import (
    MicroBatch,
    length_sorted_chunks,
    pad_groups,
    put,
    take,
    turn_inputs,
)
from rollflash.learner.critic import Critic, build_critic
from rollflash.learner.filters import group_scores, truncated
from rollflash.learner.packing import budget_chunks
from rollflash.learner.reference import AdaptersOffReference, ReferencePolicy


@dataclass
class AlgoModels:
    """What the algorithm needs beside the policy and its optimiser."""

    reference: ReferencePolicy | None = None  # frozen initial policy, when kl_coef > 0
    critic: Critic | None = None  # value model, when algo.critic
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_norm: RunningRewardNorm = field(
        default_factory=RunningRewardNorm
    )  # reward_norm: running


def build_algo_models(cfg: Config, policy: torch.nn.Module | None = None) -> AlgoModels:
    """Load the reference and build the critic only when the config uses them; with LoRA the
    reference is `policy` (the peft model) with its adapters off."""
    models = AlgoModels()
    if cfg.algo.kl_coef > 0 and cfg.model.lora is not None:
        models.reference = AdaptersOffReference(policy)
    elif cfg.algo.kl_coef > 0:
        models.reference = ReferencePolicy.load(cfg.model.path, cfg.model.dtype)
    if cfg.algo.critic:
        models.critic, models.critic_optimizer = build_critic(cfg)
    return models


@dataclass
class PreparedBatch:
    micro_batches: list[MicroBatch]
    metrics: dict[str, float]  # reward shaping, advantage and reference-KL statistics


@torch.no_grad()
def _model_inputs(
    full: MicroBatch, chunks: list[torch.Tensor], cfg: Config, models: AlgoModels
) -> None:
    """Fill full.ref_logp and full.old_values ([B, L-1] float32), one micro-batch at a time."""
    if models.reference is not None:
        full.ref_logp = torch.zeros_like(full.behav_logp)
    if models.critic is not None:
        full.old_values = torch.zeros_like(full.behav_logp)
        models.critic.eval()
    for rows in chunks:
        mb = take(full, rows)
        packed = cfg.trainer.token_budget > 0
        if full.ref_logp is not None:
            put(full.ref_logp, rows, models.reference.logprobs(mb, cfg.rollout.temperature, packed))
        if full.old_values is not None:
            put(full.old_values, rows, models.critic(mb.input_ids, mb.attention_mask, packed))


def _advantages(
    full: MicroBatch,
    scores: torch.Tensor,
    cfg: Config,
    models: AlgoModels,
    groups: list[Trajectory],
) -> dict[str, float]:
    """Set full.advantages (and full.returns with a critic) from group-major scores [G, n]."""
    a = cfg.algo
    normed = normalize_rewards(scores, a.reward_norm, running=models.reward_norm)  # [G, n]
    token_rewards, metrics = None, {}
    if full.ref_logp is not None:
        kl = kl_penalty(full.behav_logp, full.ref_logp, a.kl_estimator, mask=full.mask)
        metrics["kl/behav_ref_kl"] = float(masked_mean(kl, full.mask))
        if a.use_kl_in_reward:
            token_rewards = kl_reward_penalty(
                full.behav_logp, full.ref_logp, full.mask, a.kl_coef, a.kl_estimator
            )
    inputs = AdvantageInputs(
        scores=normed.reshape(-1),
        mask=full.mask,
        group_size=scores.shape[1],
        values=full.old_values,
        token_rewards=token_rewards,
        turns=turn_inputs(groups, full.mask),
    )
    out = ADVANTAGE_ESTIMATORS[a.adv_estimator](inputs, AdvantageConfig(gamma=a.gamma, lam=a.lam))
    adv = masked_whiten(out.advantages, full.mask) if a.whiten_advantages else out.advantages
    full.advantages = adv
    if models.critic is not None:
        full.returns = out.returns
    return {
        **metrics,
        "advantage/mean": float(masked_mean(adv, full.mask)),
        "advantage/abs_mean": float(masked_mean(adv.abs(), full.mask)),
    }


def prepare_batch(groups: list[Trajectory], cfg: Config, models: AlgoModels) -> PreparedBatch:
    """Micro-batches for the groups (all of size n): at most `trainer.micro_batch_size` sequences,
    or with `trainer.token_budget` at most that many tokens, packed (learner/packing.py)."""
    scores = torch.stack([group_scores(g, cfg) for g in groups])  # [G, n]
    cut = torch.cat([truncated(g) for g in groups])  # [B] bool
    full = pad_groups(groups, keep=~cut if cfg.algo.overlong_filter else None)
    chunks = (
        budget_chunks(full.lengths, cfg.trainer.token_budget)
        if cfg.trainer.token_budget
        else length_sorted_chunks(full, cfg.trainer.micro_batch_size)
    )
    _model_inputs(full, chunks, cfg, models)
    metrics = _advantages(full, scores, cfg, models, groups)
    raw = torch.tensor([s.reward for g in groups for s in g.samples])
    metrics.update(
        {
            "reward/score_mean": float(scores.mean()),
            "reward/shaping_mean": float(scores.reshape(-1).mean() - raw.mean()),
            "response/truncated_frac": float(cut.float().mean()),
        }
    )
    return PreparedBatch([take(full, rows) for rows in chunks], metrics)
