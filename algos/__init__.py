"""Pure tensor math for RL post-training: advantages, policy/value losses, off-policy corrections, KL,
entropy, aggregation, reward shaping and sample filtering. Imports torch only; see docs/algorithms.md."""

from rollflash.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutput,
    broadcast_to_tokens,
    grpo_advantages,
    rloo_advantages,
)
from rollflash.algos.aggregation import AGG_MODES, aggregate
from rollflash.algos.dapo import (
    dynamic_sampling_mask,
    overlong_filter_mask,
    soft_overlong_penalty,
)
from rollflash.algos.entropy import entropy_bonus, entropy_from_logits
from rollflash.algos.kl import K3_LIMIT, KL_ESTIMATORS, approx_kl, kl_loss, kl_penalty, was_clamped
from rollflash.algos.kl_control import adaptive_kl_coef, next_kl_coef
from rollflash.algos.masked import masked_max, masked_mean, masked_sum, masked_whiten
from rollflash.algos.offpolicy import IS_LEVELS, IS_MODES, ISWeights, importance_weights
from rollflash.algos.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    cispo_loss,
    clipped_surrogate,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
)
from rollflash.algos.preference import bradley_terry_loss
from rollflash.algos.ratio import LOG_RATIO_LIMIT, exp_ratio
from rollflash.algos.returns import discounted_returns, gae_advantages, place_terminal_reward
from rollflash.algos.rewards import (
    REWARD_NORMS,
    RunningRewardNorm,
    clip_rewards,
    kl_reward_penalty,
    normalize_rewards,
)
from rollflash.algos.turn_advantages import (
    TurnInputs,
    step_group_advantages,
    turn_returns,
    turns_to_tokens,
)
from rollflash.algos.types import LossOutput
from rollflash.algos.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "CRITIC_ESTIMATORS",
    "IS_LEVELS",
    "IS_MODES",
    "K3_LIMIT",
    "KL_ESTIMATORS",
    "LOG_RATIO_LIMIT",
    "POLICY_LOSSES",
    "REWARD_NORMS",
    "AdvantageConfig",
    "AdvantageInputs",
    "AdvantageOutput",
    "ISWeights",
    "LossOutput",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "RunningRewardNorm",
    "TurnInputs",
    "adaptive_kl_coef",
    "aggregate",
    "approx_kl",
    "bradley_terry_loss",
    "broadcast_to_tokens",
    "cispo_loss",
    "clip_rewards",
    "clipped_surrogate",
    "discounted_returns",
    "dynamic_sampling_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "exp_ratio",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "next_kl_coef",
    "normalize_rewards",
    "overlong_filter_mask",
    "place_terminal_reward",
    "ppo_clip_loss",
    "reinforce_loss",
    "rloo_advantages",
    "soft_overlong_penalty",
    "step_group_advantages",
    "topr_loss",
    "turn_returns",
    "turns_to_tokens",
    "value_loss",
    "was_clamped",
]
