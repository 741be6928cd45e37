"""The losses of one micro-batch: what a learner update differentiates.

    policy: loss = POLICY_LOSSES[policy_loss] + kl_coef * kl_loss + entropy_coef * bonus
    critic: loss = value_loss(values, old_values, returns)              (critic: true)

Every term is aggregated by `loss_agg_mode` over the micro-batch; learner/step/train.py weighs each
micro-batch's loss by its share of the mini-batch, so the accumulated gradient is the mini-batch's.

The ratio's denominator is the proximal policy (learner/step/train.py): the micro-batch's
`prox_logp` when the step makes several updates, else the update's own detached log-probs, so
that the ratio is exactly 1. The KL term is against the frozen reference (`ref_logp`), unless
`use_kl_in_reward` put it in the reward instead (learner/step/prepare.py).

Entropy of the sampled positions (`policy/entropy`) is always logged, from the logits the update
computes anyway; it takes part in the gradient only with `algo.entropy_coef` > 0.

The micro-batch's log-probs come from the step's one LogprobSpec (learner/step/logprobs.py), which
also hands the model any further inputs the micro-batch carries: nothing here reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollflash.algos import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    approx_kl,
    entropy_bonus,
    exp_ratio,
    kl_loss,
    masked_max,
    masked_mean,
    value_loss,
)
from rollflash.broker.config.config_algo import AlgoConfig
from rollflash.learner.metrics.mismatch import generator_mismatch
from rollflash.learner.step.batch import MicroBatch
from rollflash.learner.step.logprobs import LogprobSpec

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config


@dataclass(frozen=True)
class LossSpec:
    """What a micro-batch's losses read, built once per step (`LossSpec.of`)."""

    algo: AlgoConfig  # the typed algo section, with the step's kl_coef (learner/metrics/guards.py)
    policy: PolicyLossConfig  # the policy loss's bounds, weights and aggregation
    logprobs: LogprobSpec  # the log-prob call (learner/step/logprobs.py)

    @classmethod
    def of(cls, cfg: Config) -> LossSpec:
        """The step's LossSpec. The constant of seq-mean-token-sum-norm is algo.norm_len, else
        the generation budget."""
        algo = cfg.algo
        policy = PolicyLossConfig(
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip_c=algo.dual_clip_c,
            tis_cap=algo.tis_cap,
            agg_mode=algo.loss_agg_mode,
            is_mode=algo.is_mode,
            is_level=algo.is_level,
            is_low=algo.is_low,
            norm_len=algo.norm_len or float(cfg.rollout.max_new_tokens),
        )
        return cls(algo, policy, LogprobSpec.of(cfg))


def mismatch_metrics(
    logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train-inference mismatch between the learner's log-probs `logp` and the generator's
    `behav` ([b, T] float32) of the tokens the generator sampled, over `mask` [b, T] bool."""
    d = logp.detach() - behav
    return {
        "mismatch/abs_dlogp_mean": masked_mean(d.abs(), mask),
        "mismatch/kl": approx_kl(behav, logp, mask),  # KL(behaviour || learner): it sampled
        "mismatch/ratio_max": masked_max(exp_ratio(d), mask),
    }


def policy_loss(
    model: torch.nn.Module, mb: MicroBatch, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's total policy loss (differentiable) and its metrics, `loss/*` included."""
    algo, agg, norm_len = spec.algo, spec.policy.agg_mode, spec.policy.norm_len
    logp, entropy = spec.logprobs(model, mb, with_entropy=True, entropy_grad=algo.entropy_coef > 0)
    out = POLICY_LOSSES[algo.policy_loss](
        PolicyLossInputs(
            logp=logp,
            prox_logp=logp.detach() if mb.prox_logp is None else mb.prox_logp,
            behav_logp=mb.behav_logp,
            advantages=mb.advantages,
            mask=mb.mask,
        ),
        spec.policy,
    )
    total = out.loss
    # against the policy before the step's updates: the version the samples are tagged with
    before = logp if mb.prox_logp is None else mb.prox_logp
    metrics = {
        **out.metrics,
        **mismatch_metrics(before, mb.behav_logp, mb.mask),
        **generator_mismatch(before, mb.behav_logp, mb.mask, mb.generator, mb.generators),
        "loss/policy": out.loss.detach(),
    }
    if mb.ref_logp is not None and not algo.use_kl_in_reward:
        kl = kl_loss(logp, mb.ref_logp, mb.mask, algo.kl_estimator, agg_mode=agg, norm_len=norm_len)
        total = total + algo.kl_coef * kl.loss
        metrics.update(kl.metrics)
        metrics["loss/kl"] = kl.loss.detach()
    if entropy is not None:
        ent = entropy_bonus(entropy, mb.mask, agg_mode=agg, norm_len=norm_len)
        metrics.update(ent.metrics)
        if algo.entropy_coef > 0:
            total = total + algo.entropy_coef * ent.loss
            metrics["loss/entropy"] = ent.loss.detach()
    metrics["loss/total"] = total.detach()
    return total, metrics


def critic_loss(
    critic: torch.nn.Module, mb: MicroBatch, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's clipped value loss against its GAE returns, and its metrics."""
    # a critic algorithm's micro-batches carry values and returns (learner/step/prepare.py)
    assert mb.old_values is not None and mb.returns is not None
    out = value_loss(
        critic(mb.input_ids, mb.attention_mask, spec.logprobs.packed),
        mb.old_values,
        mb.returns,
        mb.mask,
        spec.algo.clip_range_value,
        agg_mode=spec.policy.agg_mode,
        norm_len=spec.policy.norm_len,
    )
    return out.loss, {**out.metrics, "loss/value": out.loss.detach()}
