"""Reduce a per-token loss [B, T] to a scalar: the `loss_agg_mode` choice.

The mode decides how long and short responses are weighed against each other, which the papers disagree on:

- "token-mean": sum over every selected token / number of selected tokens. Each token weighs the same,
  so long responses weigh more. DAPO (Yu et al. 2025, "DAPO", Sec. 3.3, token-level policy gradient loss).
- "seq-mean-token-mean": mean over each response's tokens, then mean over responses. Each response
  weighs the same. The original GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3).
- "seq-mean-token-sum": sum over each response's tokens, then mean over responses.
- "seq-mean-token-sum-norm": sum over each response's tokens divided by a constant `norm_len`
  (the generation budget, e.g. max_new_tokens), then mean over responses. Dr.GRPO (Liu et al. 2025,
  "Understanding R1-Zero-Like Training: A Critical Perspective", Sec. 3.1) removes the 1/|o_i| length
  normalisation because it biases towards long wrong answers; a constant keeps the loss scale fixed.

Departures: the "seq-mean-*" modes average over responses that have at least one selected token, so an
all-masked row (a filtered or padding sample) does not dilute the others. `norm_len` is required for the
Dr.GRPO mode rather than defaulting to T, because T is the padded width of this batch, not a constant.
All modes return exactly 0 (with zero gradient, never NaN) when nothing is selected.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rollflash.algos.masked import masked_mean, masked_sum


def _row_mean(per_row: Tensor, mask: Tensor) -> Tensor:
    """per_row [B] float, mask [B, T] bool -> []: mean over rows with at least one selected token."""
    return masked_mean(per_row, mask.any(dim=-1))


def _token_mean(values: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    return masked_mean(values, mask)


def _seq_mean_token_mean(values: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    return _row_mean(masked_mean(values, mask, dim=-1), mask)


def _seq_mean_token_sum(values: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    return _row_mean(masked_sum(values, mask, dim=-1), mask)


def _seq_mean_token_sum_norm(values: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    if norm_len is None or norm_len <= 0:
        raise ValueError(
            f"loss_agg_mode 'seq-mean-token-sum-norm' needs a positive constant norm_len, got {norm_len!r}"
        )
    return _row_mean(masked_sum(values, mask, dim=-1) / norm_len, mask)


AGG_MODES: dict[str, Callable[[Tensor, Tensor, float | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(values: Tensor, mask: Tensor, mode: str, *, norm_len: float | None = None) -> Tensor:
    """Reduce per-token values to a scalar by `mode` (see module docstring).

    values: [B, T] float, per-token loss (may hold -inf/NaN at masked positions)
    mask:   [B, T] bool, tokens that count
    norm_len: constant divisor for "seq-mean-token-sum-norm" (ignored by the other modes)
    -> [] same dtype as values, differentiable
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(AGG_MODES)}")
    if values.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"values {tuple(values.shape)} and bool mask {tuple(mask.shape)} must match"
        )
    return AGG_MODES[mode](values, mask, norm_len)
