"""Batch-level statistics over every rank's share of the step, so that N ranks compute what one
rank would on the whole batch.

- `reward_norm: batch` and `running`: the ranks' scores are gathered (B x n floats), normalised
  together with algos' own functions, and each rank keeps its rows; the running statistics are
  updated with the whole step's scores on every rank, so they stay identical and the checkpoint
  (written by rank 0) holds the run's statistics.
- `whiten_advantages`: the masked mean and unbiased std are global (sums over ranks, float64).
- `global_mean`: a masked mean whose numerator and count are summed over the ranks, for metrics;
  `global_std`: the population std of the step's rewards (`guard/score_std`).

Every function here is a collective when there are several ranks: every rank calls it, with an
empty share if it has no groups this step.
"""

from __future__ import annotations

import math

import torch

from rollflash.algos import RunningRewardNorm, normalize_rewards
from rollflash.learner.process.dist import Dist


def normalize_scores(
    scores: torch.Tensor, mode: str, running: RunningRewardNorm, dist: Dist
) -> torch.Tensor:
    """scores [G, n] float32 (this rank's groups) -> [G, n], normalised as one rank would
    normalise the whole step's [sum G, n]. `group` and `none` need no other rank."""
    if dist.world_size == 1 or mode in ("none", "group"):
        return normalize_rewards(scores, mode, running=running)
    parts = dist.gather(scores.tolist())
    n = scores.shape[1]
    everything = torch.tensor([row for part in parts for row in part], dtype=scores.dtype)
    normed = normalize_rewards(everything.reshape(-1, n), mode, running=running)
    start = sum(len(part) for part in parts[: dist.rank])
    return normed[start : start + scores.shape[0]]


def global_mean(values: torch.Tensor, mask: torch.Tensor, dist: Dist) -> float:
    """Mean of `values` where `mask` is True over every rank's elements (0 if there are none)."""
    total, count = dist.sums([float(values[mask].double().sum()), float(mask.sum())])
    return total / count if count else 0.0


def whiten(values: torch.Tensor, mask: torch.Tensor, dist: Dist, eps: float = 1e-8) -> torch.Tensor:
    """algos.masked_whiten with the mean and unbiased std of every rank's selected elements.

    values: [B, T] float32, mask: [B, T] bool -> [B, T] float32, 0 where mask is False."""
    mean = global_mean(values, mask, dist)
    (sq,) = dist.sums([float(((values[mask].double() - mean) ** 2).sum())])
    (count,) = dist.sums([float(mask.sum())])
    std = math.sqrt(sq / (count - 1)) if count > 1 else 0.0
    out = (values - mean) / (std + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def global_std(values: list[float], dist: Dist) -> float:
    """Population std of every rank's `values` (0 for fewer than 2), as guards.score_std."""
    count, total = dist.sums([len(values), sum(values)])
    if count < 2:
        return 0.0
    (sq,) = dist.sums([sum((v - total / count) ** 2 for v in values)])
    return math.sqrt(sq / count)
