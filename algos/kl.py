"""KL estimators between the current policy and a reference policy (`kl_estimator`, `kl_coef`).

From samples y ~ pi (the sampled tokens), with log r = log pi_ref(y) - log pi(y) (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html), each estimates KL(pi || pi_ref):

- "k1": -log r = log pi - log pi_ref. Unbiased, high variance, can be negative.
- "k2": (log r)^2 / 2. Biased, low variance, >= 0.
- "k3": (r - 1) - log r. Unbiased, low variance, >= 0 (GRPO's choice, DeepSeekMath eq. 4).

As a loss term their gradients differ from their values' meaning (Tang & Munos 2025, "On a few pitfalls
in KL divergence gradient estimation for RL"): grad of the k2 loss is the on-policy gradient of KL(pi ||
pi_ref); k1 as a loss has zero expected gradient on-policy; k3 as a loss (GRPO) gives the gradient of the
reverse KL(pi_ref || pi). In the reward (`kl_reward_penalty`) the value is what matters, k1 is usual.

k3 is the one estimate of a KL in the project: the KL loss, the KL penalty in the reward and every
KL metric (`kl/*`, `policy/approx_kl`, `offpolicy/approx_kl`, `mismatch/kl`) call `kl_penalty` or
`approx_kl`. As in verl's `low_var_kl`, its log ratio is clamped to +-20 before exp (algos/ratio.py)
and its value to K3_LIMIT = 10: one token whose log ratio is -15 would otherwise weigh e^15 = 3.3e6,
and after gradient-norm clipping steer the whole update. Where the value is clamped its gradient is
0 (the token stops pulling); `kl/clamped_frac` counts those tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rollflash.algos.aggregation import aggregate
from rollflash.algos.masked import masked_fill_zero, masked_mean
from rollflash.algos.ratio import clamp_log_ratio
from rollflash.algos.types import LossOutput

# k3 is clamped to [-K3_LIMIT, K3_LIMIT] (verl's low_var_kl: [-10, 10]; k3 >= 0, so the upper edge)
K3_LIMIT = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _k3(log_ratio: Tensor) -> Tensor:
    # log_ratio = log pi - log pi_ref = -log r  ->  (r - 1) - log r = e^(-lr) - 1 + lr
    lr = clamp_log_ratio(log_ratio)
    return ((-lr).exp() - 1 + lr).clamp(-K3_LIMIT, K3_LIMIT)


# kind -> (log pi - log pi_ref [B, T]) -> per-token estimate [B, T]
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, kind: str = "k3", *, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref).

    logp:     [B, T] float32, current (or behaviour) policy log-probs of the sampled tokens
    ref_logp: [B, T] float32, reference policy log-probs of the same tokens
    mask:     [B, T] bool, optional; if given, masked positions are exactly 0 (inputs replaced before math)
    -> [B, T] float32, differentiable w.r.t. logp
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    if mask is not None:
        logp, ref_logp = masked_fill_zero(logp, mask), masked_fill_zero(ref_logp, mask)
    out = KL_ESTIMATORS[kind](logp - ref_logp.detach())
    return out if mask is None else masked_fill_zero(out, mask)


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: str = "k3",
    *,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """KL-to-reference as a loss term (GRPO style): the caller adds kl_coef * out.loss.

    logp [B, T] float32 (grad), ref_logp [B, T] float32, mask [B, T] bool -> LossOutput, metrics
    "kl/ref_kl" (the aggregated estimate) and "kl/clamped_frac" (tokens clamped at K3_LIMIT).
    """
    per_token = kl_penalty(logp, ref_logp, kind, mask=mask)
    loss = aggregate(per_token, mask, agg_mode, norm_len=norm_len)
    clamped = was_clamped(per_token, kind).to(per_token.dtype)
    metrics = {"kl/ref_kl": loss.detach(), "kl/clamped_frac": masked_mean(clamped, mask)}
    return LossOutput(loss=loss, metrics=metrics)


def was_clamped(per_token: Tensor, kind: str) -> Tensor:
    """per_token [B, T] float32 (`kl_penalty`'s output) -> [B, T] bool: where the estimate was
    clamped at K3_LIMIT (only k3 is clamped)."""
    if kind != "k3":
        return torch.zeros_like(per_token, dtype=torch.bool)
    return per_token.detach().abs() >= K3_LIMIT


def approx_kl(sampler_logp: Tensor, other_logp: Tensor, mask: Tensor) -> Tensor:
    """The k3 estimate of KL(sampler || other) from tokens drawn from the sampler, a token mean.

    sampler_logp: [B, T] float32, log-probs of the sampled tokens under the policy that drew them
    other_logp:   [B, T] float32, log-probs of the same tokens under the other policy
    mask:         [B, T] bool
    -> [] detached; the direction matters: with d = log other - log sampler, each token is
    e^d - 1 - d (KL(sampler || other)), not e^-d - 1 + d (which estimates nothing).
    """
    per_token = kl_penalty(sampler_logp.detach(), other_logp.detach(), "k3", mask=mask)
    return masked_mean(per_token, mask)
