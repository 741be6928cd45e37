"""validate_algo_choice: every error names its key."""

import pytest

from rollflash.algos.validate import validate_algo_choice

BASE = dict(adv_estimator="grpo", policy_loss="ppo", has_critic=False)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(adv_estimator="gae", has_critic=True, clip_range_value=0.2, gamma=0.99, lam=0.95),
        dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, is_level="sequence"),
        dict(
            is_mode="mask", tis_cap=5.0, is_low=0.5, dynamic_sampling=True, num_return_sequences=8
        ),
        dict(loss_agg_mode="seq-mean-token-sum-norm", norm_len=1024, adv_estimator="dr_grpo"),
        dict(overlong_buffer=256, max_new_tokens=1024, tis_cap=None, dual_clip_c=None),
    ],
)
def test_valid_choices_pass(overrides):
    validate_algo_choice(**{**BASE, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(adv_estimator="gae"),
            "algo.adv_estimator: 'gae' needs a critic (set algo.critic: true)",
        ),
        (
            dict(has_critic=True),
            "algo.critic: true but algo.adv_estimator 'grpo' does not use a critic",
        ),
        (
            dict(adv_estimator="gpro"),
            "algo.adv_estimator: unknown 'gpro'; known: dr_grpo, gae, gigpo, grpo",
        ),
        (
            dict(policy_loss="ppo2"),
            "algo.policy_loss: unknown 'ppo2'; known: cispo, gspo, ppo, reinforce, topr",
        ),
        (dict(is_mode="clip"), "algo.is_mode: unknown 'clip'; known: mask, truncate"),
        (dict(is_level="seq"), "algo.is_level: unknown 'seq'; known: geometric, sequence, token"),
        (
            dict(kl_estimator="low_var_kl"),
            "algo.kl_estimator: unknown 'low_var_kl'; known: k1, k2, k3",
        ),
        (dict(loss_agg_mode="mean"), "algo.loss_agg_mode: unknown 'mean'"),
        (dict(reward_norm="zscore"), "algo.reward_norm: unknown 'zscore'"),
        (dict(clip_low=1.5), "algo.clip_low must be in (0, 1), got 1.5"),
        (dict(clip_low=0.0), "algo.clip_low must be in (0, 1), got 0.0"),
        (dict(clip_high=-0.1), "algo.clip_high must be > 0"),
        (dict(dual_clip_c=1.0), "algo.dual_clip_c must be > 1"),
        (dict(tis_cap=0.5), "algo.tis_cap must be >= 1"),
        (dict(is_low=0.5), "algo.is_low is only used with algo.is_mode: mask"),
        (dict(is_mode="mask", is_low=1.5), "algo.is_low must be in [0, 1]"),
        (dict(kl_coef=-0.1), "algo.kl_coef must be >= 0"),
        (dict(entropy_coef=-1.0), "algo.entropy_coef must be >= 0"),
        (
            dict(loss_agg_mode="seq-mean-token-sum-norm"),
            "algo.loss_agg_mode: 'seq-mean-token-sum-norm' needs",
        ),
        (dict(gamma=1.5), "algo.gamma must be in [0, 1], got 1.5"),
        (dict(lam=-0.1), "algo.lam must be in [0, 1]"),
        (dict(clip_range_value=0.0), "algo.clip_range_value must be > 0"),
        (dict(reward_clip=-1.0), "algo.reward_clip must be > 0"),
        (dict(overlong_penalty_factor=0.0), "algo.overlong_penalty_factor must be > 0"),
        (dict(overlong_buffer=0), "algo.overlong_buffer must be > 0"),
        (
            dict(overlong_buffer=1024, max_new_tokens=1024),
            "algo.overlong_buffer must be < max_new_tokens",
        ),
        (
            dict(num_return_sequences=1),
            "algo.adv_estimator: 'grpo' needs num_return_sequences >= 2",
        ),
        (
            dict(adv_estimator="reinforce++", dynamic_sampling=True, num_return_sequences=1),
            "algo.dynamic_sampling needs num_return_sequences >= 2",
        ),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError) as info:
        validate_algo_choice(**{**BASE, **overrides})
    assert str(info.value).startswith(message), str(info.value)
