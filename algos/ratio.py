"""Log-ratios of two policies' token log-probabilities, and their exponent.

Every ratio in `algos/` (the PPO ratio, the off-policy weight, the k3 estimate of a KL) is
exp(log pi_a - log pi_b); the log ratio is clamped to +-LOG_RATIO_LIMIT before exp, so that a
-inf or very stale log-prob gives a large finite number rather than inf or NaN (verl clamps the
same log ratio to +-20 in its policy losses and its k3).
"""

from __future__ import annotations

from torch import Tensor

# e^20 = 4.9e8 is beyond any useful ratio; e^89 is inf in float32
LOG_RATIO_LIMIT = 20.0


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """log_ratio [..] float -> [..] clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def exp_ratio(log_ratio: Tensor) -> Tensor:
    """log_ratio [..] float -> the ratio [..], exp of the clamped log ratio."""
    return clamp_log_ratio(log_ratio).exp()
