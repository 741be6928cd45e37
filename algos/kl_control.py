"""The KL-penalty coefficient: fixed, or adapted towards a target KL (`algo.kl_coef`, `kl_target`,
`kl_horizon`).

Adaptive controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences",
§2.2), used by InstructGPT and by trl / OpenRLHF as `AdaptiveKLController`:

    e_t      = clip(KL_t / KL_target - 1, -0.2, 0.2)
    beta_t+1 = beta_t * (1 + e_t * n_t / horizon)

where KL_t is the KL to the reference measured on the step's samples and n_t the number of samples
the step trained on (so `horizon` is in samples; Ziegler et al. use 10 000). Above the target beta
grows, below it shrinks, by at most 20% per `horizon` samples.

Departure: KL_t here is the per-token mean of the configured `kl_estimator` over the response tokens
(`kl/behav_ref_kl`), as OpenRLHF, not Ziegler's per-sequence sum, so `kl_target` is per token.
Pure function: the learner holds beta between steps.
"""

from __future__ import annotations

import math

MAX_PROPORTIONAL_ERROR = 0.2  # Ziegler et al. 2019: the error is clipped to +-0.2


def adaptive_kl_coef(
    coef: float, observed_kl: float, target: float, horizon: float, n_samples: int
) -> float:
    """The next KL coefficient beta_{t+1} from beta_t = `coef` (formula in the module docstring).

    coef > 0, target > 0, horizon > 0, n_samples >= 0. A non-finite `observed_kl` (no sample had a
    response token) leaves the coefficient unchanged.
    """
    if not (coef > 0 and target > 0 and horizon > 0 and n_samples >= 0):
        raise ValueError(
            f"adaptive_kl_coef: need coef, target, horizon > 0 and n_samples >= 0, got "
            f"coef={coef!r} target={target!r} horizon={horizon!r} n_samples={n_samples!r}"
        )
    if not math.isfinite(observed_kl):
        return coef
    error = min(max(observed_kl / target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
    return coef * (1.0 + error * n_samples / horizon)


def next_kl_coef(
    coef: float, observed_kl: float, target: float | None, horizon: float, n_samples: int
) -> float:
    """`coef` unchanged when `target` is None (fixed coefficient), else `adaptive_kl_coef`."""
    if target is None:
        return coef
    return adaptive_kl_coef(coef, observed_kl, target, horizon, n_samples)
