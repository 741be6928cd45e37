"""Sample filtering and length shaping from DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale"): dynamic sampling (`dynamic_sampling`), overlong filtering and the soft overlong
punishment (`overlong_buffer`).

These return masks / penalties; dropping rows or refilling the batch is the caller's business.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_mask(rewards: Tensor, atol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling (Sec. 3.2, eq. 11 constraint 0 < |{correct}| < G): keep groups whose rewards
    are not all equal, since a group with equal rewards has zero group-relative advantage and no gradient.

    rewards: [G, n] float32 -> [G] bool (True = keep). Groups whose max - min <= atol count as all equal.
    """
    spread = rewards.amax(dim=-1) - rewards.amin(dim=-1)
    return spread > atol


def overlong_filter_mask(truncated: Tensor) -> Tensor:
    """DAPO overlong filtering (Sec. 3.4): truncated samples are masked out of the loss, since a cut-off
    response's reward says little about its reasoning.

    truncated: [B] bool (generation hit max_new_tokens without EOS) -> [B] bool (True = keep).
    Apply to the token mask as mask & keep.unsqueeze(-1).
    """
    return ~truncated


def soft_overlong_penalty(
    lengths: Tensor, max_len: int, buffer: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Sec. 3.4, eq. 13), added to the score:

        R(y) = 0                          if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
             = -1                         if |y| > L_max

    times penalty_factor (verl's overlong_buffer.penalty_factor), with L_max = max_len, L_cache = buffer.

    lengths: [B] int response lengths -> [B] float32, in [-penalty_factor, 0].
    """
    if buffer <= 0:
        raise ValueError(f"overlong_buffer must be positive, got {buffer}")
    expected = max_len - buffer
    exceed = lengths.to(torch.float32) - expected
    return (-exceed / buffer).clamp(-1.0, 0.0) * penalty_factor
