"""Masked reductions over padded token tensors.

Every reduction selects with `torch.where` rather than multiplying by the mask: a masked position may hold
-inf or NaN (log-probs of padding), and `0 * inf` is NaN, whereas `where` drops the value outright.
A reduction over zero selected elements returns 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_fill_zero(values: Tensor, mask: Tensor) -> Tensor:
    """values [..] any float, mask [..] bool (broadcastable) -> [..]: values where mask, exactly 0
    elsewhere."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the selected elements; over `dim` if given, else over everything -> [].

    values: [B, T] float; mask: [B, T] bool.
    """
    selected = masked_fill_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of selected elements as an int64 tensor (over `dim` if given)."""
    return mask.sum() if dim is None else mask.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of the selected elements; 0 where nothing is selected.

    values: [B, T] float; mask: [B, T] bool -> [] (dim None) or the reduced shape.
    """
    count = masked_count(mask, dim).clamp(min=1).to(values.dtype)
    return masked_sum(values, mask, dim) / count


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of the selected elements over everything -> []; 0 where nothing is selected."""
    if values.numel() == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    neg_inf = torch.full((), float("-inf"), dtype=values.dtype, device=values.device)
    best = torch.where(mask, values, neg_inf).amax()
    return torch.where(mask.any(), best, torch.zeros_like(best))


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the selected elements over everything -> [].

    unbiased divides by (count - 1) (Bessel); with fewer than 2 selected elements the variance is 0.
    """
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    count = masked_count(mask).to(values.dtype)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(
    values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True
) -> Tensor:
    """(values - mean) / (std + eps) with statistics over the selected elements; 0 at masked positions.

    values: [B, T] float; mask: [B, T] bool -> [B, T]. shift_mean=False only rescales (mean kept).
    """
    mean = masked_mean(values, mask)
    std = masked_var(values, mask, unbiased=True).sqrt()
    centred = values - mean if shift_mean else values
    return masked_fill_zero(centred / (std + eps), mask)
