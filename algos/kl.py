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

The log ratio is clamped to +-20 before exp (k3), so a -inf log-prob cannot make inf/NaN.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rollflash.algos.aggregation import aggregate
from rollflash.algos.masked import masked_fill_zero
from rollflash.algos.offpolicy import LOG_RATIO_LIMIT
from rollflash.algos.types import LossOutput


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _k3(log_ratio: Tensor) -> Tensor:
    # log_ratio = log pi - log pi_ref = -log r  ->  (r - 1) - log r = e^(-lr) - 1 + lr
    lr = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (-lr).exp() - 1 + lr


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

    logp [B, T] float32 (grad), ref_logp [B, T] float32, mask [B, T] bool -> LossOutput, metric "kl/ref_kl".
    """
    per_token = kl_penalty(logp, ref_logp, kind, mask=mask)
    loss = aggregate(per_token, mask, agg_mode, norm_len=norm_len)
    return LossOutput(loss=loss, metrics={"kl/ref_kl": loss.detach()})
