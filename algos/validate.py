"""Load-time checks of the algorithm section of a config (`algo.*`).

The config loader calls `validate_algo_choice` once; every error is a ValueError whose message starts with
the offending key, says what was wrong and, for names, lists the known ones.
"""

from __future__ import annotations

from typing import Any

from rollflash.algos.advantages import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS
from rollflash.algos.aggregation import AGG_MODES
from rollflash.algos.kl import KL_ESTIMATORS
from rollflash.algos.offpolicy import IS_LEVELS, IS_MODES
from rollflash.algos.policy_loss import POLICY_LOSSES
from rollflash.algos.rewards import REWARD_NORMS

# estimators whose baseline needs more than one sample per prompt
_GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce++-baseline", "gigpo"})


def _known(key: str, value: str, registry: Any) -> None:
    if value not in registry:
        raise ValueError(f"algo.{key}: unknown {value!r}; known: {', '.join(sorted(registry))}")


def _in_range(
    key: str, value: float, low: float, high: float, *, low_open: bool, high_open: bool
) -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"algo.{key} must be in {interval}, got {value!r}")


def _optional_positive(key: str, value: float | None, minimum: float = 0.0) -> None:
    if value is not None and not value > minimum:
        raise ValueError(f"algo.{key} must be > {minimum:g} (or null to disable), got {value!r}")


def validate_algo_choice(
    adv_estimator: str,
    policy_loss: str,
    has_critic: bool,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    tis_cap: float | None = 2.0,
    is_mode: str = "truncate",
    is_level: str = "token",
    is_low: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    loss_agg_mode: str = "token-mean",
    norm_len: float | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip_range_value: float | None = None,
    reward_clip: float | None = None,
    reward_norm: str = "none",
    dynamic_sampling: bool = False,
    overlong_buffer: int | None = None,
    overlong_penalty_factor: float = 1.0,
    max_new_tokens: int | None = None,
    num_return_sequences: int | None = None,
) -> None:
    """Raise ValueError naming the key if the combination is unknown, out of range or inconsistent.

    has_critic is the config's algo.critic; max_new_tokens and num_return_sequences (from the rollout
    section) enable the checks that depend on them when given.
    """
    _known("adv_estimator", adv_estimator, ADVANTAGE_ESTIMATORS)
    _known("policy_loss", policy_loss, POLICY_LOSSES)
    _known("is_mode", is_mode, IS_MODES)
    _known("is_level", is_level, IS_LEVELS)
    _known("kl_estimator", kl_estimator, KL_ESTIMATORS)
    _known("loss_agg_mode", loss_agg_mode, AGG_MODES)
    _known("reward_norm", reward_norm, REWARD_NORMS)
    _check_estimator(adv_estimator, has_critic, dynamic_sampling, num_return_sequences)
    _check_policy(clip_low, clip_high, dual_clip_c, tis_cap, is_mode, is_low)
    _check_coefficients(kl_coef, entropy_coef, loss_agg_mode, norm_len, gamma, lam)
    _optional_positive("clip_range_value", clip_range_value)
    _optional_positive("reward_clip", reward_clip)
    _check_overlong(overlong_buffer, overlong_penalty_factor, max_new_tokens)


def _check_estimator(
    adv_estimator: str, has_critic: bool, dynamic_sampling: bool, num_return_sequences: int | None
) -> None:
    if adv_estimator in CRITIC_ESTIMATORS and not has_critic:
        raise ValueError(
            f"algo.adv_estimator: {adv_estimator!r} needs a critic (set algo.critic: true)"
        )
    if has_critic and adv_estimator not in CRITIC_ESTIMATORS:
        raise ValueError(
            f"algo.critic: true but algo.adv_estimator {adv_estimator!r} does not use a critic "
            f"(use one of {', '.join(sorted(CRITIC_ESTIMATORS))}, or set algo.critic: false)"
        )
    if num_return_sequences is None or num_return_sequences >= 2:
        return
    if adv_estimator in _GROUP_ESTIMATORS:
        raise ValueError(
            f"algo.adv_estimator: {adv_estimator!r} needs num_return_sequences >= 2 for its group "
            f"baseline, got {num_return_sequences}"
        )
    if dynamic_sampling:
        raise ValueError(
            f"algo.dynamic_sampling needs num_return_sequences >= 2 (a group of 1 is always "
            f"all-equal and would be dropped), got {num_return_sequences}"
        )


def _check_policy(
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    tis_cap: float | None,
    is_mode: str,
    is_low: float | None,
) -> None:
    _in_range("clip_low", clip_low, 0.0, 1.0, low_open=True, high_open=True)
    _optional_positive("clip_high", clip_high)
    _optional_positive("dual_clip_c", dual_clip_c, minimum=1.0)
    if tis_cap is not None and not tis_cap >= 1.0:
        raise ValueError(f"algo.tis_cap must be >= 1 (or null for no correction), got {tis_cap!r}")
    if is_low is not None:
        _in_range("is_low", is_low, 0.0, 1.0, low_open=False, high_open=False)
        if is_mode != "mask":
            raise ValueError(
                f"algo.is_low is only used with algo.is_mode: mask, got is_mode {is_mode!r}"
            )


def _check_coefficients(
    kl_coef: float,
    entropy_coef: float,
    loss_agg_mode: str,
    norm_len: float | None,
    gamma: float,
    lam: float,
) -> None:
    if not kl_coef >= 0.0:
        raise ValueError(f"algo.kl_coef must be >= 0, got {kl_coef!r}")
    if not entropy_coef >= 0.0:
        raise ValueError(f"algo.entropy_coef must be >= 0, got {entropy_coef!r}")
    if loss_agg_mode == "seq-mean-token-sum-norm" and (norm_len is None or not norm_len > 0):
        raise ValueError(
            f"algo.loss_agg_mode: 'seq-mean-token-sum-norm' needs a positive algo.norm_len "
            f"(usually max_new_tokens), got {norm_len!r}"
        )
    _in_range("gamma", gamma, 0.0, 1.0, low_open=False, high_open=False)
    _in_range("lam", lam, 0.0, 1.0, low_open=False, high_open=False)


def _check_overlong(
    overlong_buffer: int | None, penalty_factor: float, max_new_tokens: int | None
) -> None:
    if not penalty_factor > 0:
        raise ValueError(f"algo.overlong_penalty_factor must be > 0, got {penalty_factor!r}")
    if overlong_buffer is None:
        return
    if overlong_buffer <= 0:
        raise ValueError(
            f"algo.overlong_buffer must be > 0 (or null to disable), got {overlong_buffer!r}"
        )
    if max_new_tokens is not None and overlong_buffer >= max_new_tokens:
        raise ValueError(
            f"algo.overlong_buffer must be < max_new_tokens ({max_new_tokens}), got {overlong_buffer}"
        )
