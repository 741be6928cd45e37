"""Critic loss (`clip_range_value`), for the GAE estimator.

Clipped value loss of PPO implementations (OpenAI baselines ppo2; Andrychowicz et al. 2021, "What Matters
in On-Policy RL", find it often does not help; keep None to disable):

    V_clip = V_old + clip(V - V_old, -c, c),   loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollflash.algos.aggregation import aggregate
from rollflash.algos.masked import masked_fill_zero, masked_mean, masked_var
from rollflash.algos.types import LossOutput


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range_value: float | None,
    *,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """values [B, T] float32 (grad), old_values [B, T] float32 (values when the batch was made, no grad),
    returns [B, T] float32 (targets from GAE), mask [B, T] bool; clip_range_value None = unclipped.

    metrics: critic/vf_clip_frac, critic/value_mean, critic/return_mean, critic/value_mse,
    critic/explained_var (1 - Var(R - V) / Var(R)).
    """
    v = masked_fill_zero(values, mask)
    old = masked_fill_zero(old_values.detach(), mask)
    ret = masked_fill_zero(returns.detach(), mask)
    err = (v - ret) ** 2
    if clip_range_value is None:
        token_loss, clipped = 0.5 * err, torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-clip_range_value, clip_range_value)
        err_clip = (v_clip - ret) ** 2
        token_loss, clipped = 0.5 * torch.maximum(err, err_clip), err_clip > err
    loss = aggregate(token_loss, mask, agg_mode, norm_len=norm_len)
    with torch.no_grad():
        var_ret = masked_var(ret, mask)
        explained = 1 - masked_var(ret - v, mask) / var_ret.clamp(min=1e-8)
        metrics = {
            "critic/vf_clip_frac": masked_mean(clipped.to(v.dtype), mask),
            "critic/value_mean": masked_mean(v, mask),
            "critic/return_mean": masked_mean(ret, mask),
            "critic/value_mse": masked_mean(err, mask),
            "critic/explained_var": torch.where(
                var_ret > 0, explained, torch.zeros_like(explained)
            ),
        }
    return LossOutput(loss=loss, metrics=metrics)
