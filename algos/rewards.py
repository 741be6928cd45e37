"""Reward shaping before advantage estimation: clipping (`reward_clip`), normalisation (`reward_norm`)
and the token-level KL penalty in the reward (`kl_coef` with `use_kl_in_reward`).

Order the learner applies: scores -> clip_rewards -> normalize_rewards -> (adv estimator), with
kl_reward_penalty supplying AdvantageInputs.token_rewards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rollflash.algos.kl import kl_penalty
from rollflash.algos.masked import masked_fill_zero


def clip_rewards(scores: Tensor, clip: float | None) -> Tensor:
    """scores [B] float32 -> [B] clamped to [-clip, clip] (None = unchanged), as OpenRLHF's
    reward_clip_range."""
    return scores if clip is None else scores.clamp(-clip, clip)


@dataclass
class RunningRewardNorm:
    """Running mean / variance of every score seen so far (Chan et al. 1979 parallel update), for
    reward_norm "running" (OpenRLHF / trlx style). Plain floats: checkpoint with dataclasses.asdict and
    restore with RunningRewardNorm(**state)."""

    count: float = 0.0  # scores seen
    mean: float = 0.0  # running mean
    m2: float = 0.0  # running sum of squared deviations

    def update(self, scores: Tensor) -> None:
        """Fold a batch of scores (any shape) into the statistics (one host sync)."""
        x = scores.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.mean().item()
        batch_m2 = ((x - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Unbiased std of everything seen; 0 before two scores."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def normalize(self, scores: Tensor, eps: float = 1e-6) -> Tensor:
        """(scores - mean) / (std + eps) with the current statistics."""
        return (scores - self.mean) / (self.std + eps)


def _norm_none(rewards: Tensor, running: RunningRewardNorm | None, eps: float) -> Tensor:
    return rewards


def _norm_batch(rewards: Tensor, running: RunningRewardNorm | None, eps: float) -> Tensor:
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def _norm_group(rewards: Tensor, running: RunningRewardNorm | None, eps: float) -> Tensor:
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)


def _norm_running(rewards: Tensor, running: RunningRewardNorm | None, eps: float) -> Tensor:
    if running is None:
        raise ValueError("reward_norm 'running' needs a RunningRewardNorm state (running=...)")
    running.update(rewards)
    return running.normalize(rewards, eps)


# mode -> (rewards [G, n], running state, eps) -> [G, n]
REWARD_NORMS: dict[str, Callable[[Tensor, RunningRewardNorm | None, float], Tensor]] = {
    "none": _norm_none,
    "batch": _norm_batch,
    "group": _norm_group,
    "running": _norm_running,
}


def normalize_rewards(
    rewards: Tensor, mode: str, *, running: RunningRewardNorm | None = None, eps: float = 1e-6
) -> Tensor:
    """rewards [G, n] float32 -> [G, n]: "none"; "batch" z-score over the whole batch; "group" z-score per
    group (unbiased std); "running" z-score with running statistics, updated with this batch first."""
    if mode not in REWARD_NORMS:
        raise ValueError(f"unknown reward_norm {mode!r}; known: {', '.join(REWARD_NORMS)}")
    return REWARD_NORMS[mode](rewards, running, eps)


def kl_reward_penalty(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_coef: float, kind: str = "k1"
) -> Tensor:
    """Token-level KL penalty folded into the reward (InstructGPT, Ouyang et al. 2022, eq. 2; Ziegler et al.
    2019): r_t = -kl_coef * KL_t(pi_behav || pi_ref), detached.

    logp [B, T] float32 (behaviour or proximal log-probs of the sampled tokens), ref_logp [B, T] float32,
    mask [B, T] bool -> [B, T] float32, 0 at masked positions; pass as AdvantageInputs.token_rewards.
    """
    with torch.no_grad():
        return masked_fill_zero(-kl_coef * kl_penalty(logp, ref_logp, kind, mask=mask), mask)
