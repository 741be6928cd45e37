"""Advantage estimators and their registry (`adv_estimator`).

Outcome (critic-free) estimators work on one scalar score per response, arranged as G groups of n samples
of the same prompt (`rewards [G, n]`): GRPO, Dr.GRPO, RLOO. Token-level estimators work on token rewards:
GAE (needs a critic), REINFORCE++ (batch-whitened discounted returns). GiGPO adds step-level
advantages for multi-turn episodes (algos/turn_advantages.py).

Registry entries share one signature, `(AdvantageInputs, AdvantageConfig) -> AdvantageOutput`, so the
learner picks one by name. Rows are group-major: row g * n + j is sample j of group g.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rollflash.algos.masked import masked_fill_zero, masked_sum, masked_whiten
from rollflash.algos.returns import discounted_returns, gae_advantages, place_terminal_reward
from rollflash.algos.turn_advantages import (
    TurnInputs,
    step_group_advantages,
    turn_returns,
    turns_to_tokens,
)


def grpo_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Group-relative advantage (Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2, outcome supervision):

        A_i = (r_i - mean(r)) / (std(r) + eps)    over the n samples of one group

    scale=False is Dr.GRPO (Liu et al. 2025, Sec. 3.1): A_i = r_i - mean(r), no std division, which the
    paper shows biases updates towards too-easy / too-hard prompts.

    std is the unbiased (n - 1) sample std, as in TRL and verl. A group of one sample gets advantage 0.

    rewards: [G, n] float32 -> [G, n] same dtype
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale:
        return centred
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", eq. 6):

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean(r))

    A group of one sample gets advantage 0 (no baseline exists).

    rewards: [G, n] float32 -> [G, n]
    """
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=-1, keepdim=True)) * (n / (n - 1))


def broadcast_to_tokens(per_seq: Tensor, mask: Tensor) -> Tensor:
    """per_seq [B] float, mask [B, T] bool -> [B, T]: the sequence value on every selected token,
    0 elsewhere."""
    return masked_fill_zero(per_seq.unsqueeze(-1).expand(mask.shape), mask)


@dataclass
class AdvantageInputs:
    scores: (
        Tensor  # [B] float32, one outcome reward per response (after clipping / shaping), B = G * n
    )
    mask: Tensor  # [B, T] bool, response tokens that count
    group_size: int  # n, samples per prompt (num_return_sequences); rows are group-major
    values: Tensor | None = None  # [B, T] float32, critic values (required by "gae")
    token_rewards: Tensor | None = (
        None  # [B, T] float32, dense rewards, e.g. -kl_coef * KL (optional)
    )
    turns: TurnInputs | None = None  # per-turn rewards and states of multi-turn episodes ("gigpo")


@dataclass
class AdvantageConfig:
    gamma: float = 1.0  # discount per token (gae, reinforce++)
    lam: float = 0.95  # GAE lambda
    eps: float = 1e-6  # added to std before dividing
    step_weight: float = 1.0  # gigpo: omega, the weight of the step-level advantage (paper: 1)


@dataclass
class AdvantageOutput:
    advantages: Tensor  # [B, T] float32, 0 at masked positions
    returns: Tensor  # [B, T] float32, critic targets (= advantages for critic-free estimators)


def _outcome_scores(x: AdvantageInputs) -> Tensor:
    """[B] scores plus the masked sum of dense token rewards (verl's convention for outcome estimators)."""
    if x.token_rewards is None:
        return x.scores
    return x.scores + masked_sum(x.token_rewards, x.mask, dim=-1)


def _as_groups(scores: Tensor, group_size: int) -> Tensor:
    """scores [B] -> [G, n], B = G * n."""
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} responses do not split into groups of {group_size}")
    return scores.view(-1, group_size)


def _grouped(x: AdvantageInputs) -> Tensor:
    return _as_groups(_outcome_scores(x), x.group_size)  # [G, n]


def _token_rewards(x: AdvantageInputs) -> Tensor:
    rewards = place_terminal_reward(x.scores, x.mask)
    return (
        rewards if x.token_rewards is None else rewards + masked_fill_zero(x.token_rewards, x.mask)
    )


def _outcome_output(per_seq: Tensor, mask: Tensor) -> AdvantageOutput:
    adv = broadcast_to_tokens(per_seq.reshape(-1), mask)
    return AdvantageOutput(advantages=adv, returns=adv)


def grpo_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    return _outcome_output(grpo_advantages(_grouped(x), eps=cfg.eps, scale=True), x.mask)


def dr_grpo_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    return _outcome_output(grpo_advantages(_grouped(x), eps=cfg.eps, scale=False), x.mask)


def rloo_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    return _outcome_output(rloo_advantages(_grouped(x)), x.mask)


def gae_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    if x.values is None:
        raise ValueError("adv_estimator 'gae' needs critic values (AdvantageInputs.values)")
    adv, returns = gae_advantages(_token_rewards(x), x.values, x.mask, cfg.gamma, cfg.lam)
    return AdvantageOutput(advantages=adv, returns=returns)


def reinforce_pp_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", Sec. 3):
    token returns G_t = sum_{s>=t} gamma^(s-t) r_s (outcome score at the end plus dense KL terms), then
    whitened over every selected token of the batch (global advantage normalisation)."""
    returns = discounted_returns(_token_rewards(x), x.mask, cfg.gamma)
    return AdvantageOutput(advantages=masked_whiten(returns, x.mask, eps=cfg.eps), returns=returns)


def reinforce_pp_baseline_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++-baseline (Hu 2025, Sec. 3.3): subtract the group-mean score first, then as REINFORCE++."""
    grouped = _as_groups(x.scores, x.group_size)  # [G, n]
    centred = (grouped - grouped.mean(dim=-1, keepdim=True)).reshape(-1)
    return reinforce_pp_estimator(
        AdvantageInputs(centred, x.mask, x.group_size, x.values, x.token_rewards), cfg
    )


def gigpo_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """GiGPO (Feng et al. 2025; algos/turn_advantages.py): episode-level GRPO plus omega times the
    step-level advantage of each turn within its group of identical states; `gamma` discounts per
    turn here (the paper: 0.95), not per token.

    Without `turns` (single-turn samples) every response is one turn taken in the prompt's state,
    which all samples of a group share: the step group is the whole group and A^S = A^E, so the
    result is (1 + omega) * GRPO, as GiGPO itself gives for one-step episodes."""
    episode = grpo_estimator(x, cfg).advantages  # [B, T]
    if x.turns is None:
        scaled = (1 + cfg.step_weight) * episode
        return AdvantageOutput(advantages=scaled, returns=scaled)
    t = x.turns
    step = step_group_advantages(
        turn_returns(t.rewards, t.mask, cfg.gamma), t.state_ids, t.mask, x.group_size, cfg.eps
    )  # [B, K]
    adv = episode + cfg.step_weight * turns_to_tokens(step, t.token_turn, x.mask)
    return AdvantageOutput(advantages=adv, returns=adv)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs, AdvantageConfig], AdvantageOutput]] = {
    "grpo": grpo_estimator,
    "dr_grpo": dr_grpo_estimator,
    "rloo": rloo_estimator,
    "gae": gae_estimator,
    "reinforce++": reinforce_pp_estimator,
    "reinforce++-baseline": reinforce_pp_baseline_estimator,
    "gigpo": gigpo_estimator,
}

# Estimators that need a value model; the config's algo section (broker/config/config_algo.py) spells
# them out and requires algo.critic: true with them.
CRITIC_ESTIMATORS: frozenset[str] = frozenset({"gae"})
