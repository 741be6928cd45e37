"""The `algo:` section's rules (broker/config/config_algo.py and the cross-section ones on Config): a valid
choice loads with exactly the values given, every error is one line naming its key."""

import pytest

from rollflash.broker.config.config import ConfigError, config_from_dict


@pytest.mark.parametrize(
    "algo, rollout",
    [
        ({}, {}),
        (dict(adv_estimator="gae", critic=True, clip_range_value=0.2, gamma=0.99, lam=0.95), {}),
        (
            dict(
                policy_loss="gspo",
                clip_low=3e-4,
                clip_high=4e-4,
                dual_clip_c=None,
                loss_agg_mode="seq-mean-token-mean",
                is_level="sequence",
            ),
            {},
        ),
        (
            dict(is_mode="mask", tis_cap=5.0, is_low=0.5, dynamic_sampling=True),
            dict(num_return_sequences=8),
        ),
        (
            dict(loss_agg_mode="seq-mean-token-sum-norm", norm_len=1024.0, adv_estimator="dr_grpo"),
            {},
        ),
        # norm_len null: the divisor is rollout.max_new_tokens, so no norm_len is needed
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), {}),
        (dict(overlong_buffer=256, tis_cap=None, dual_clip_c=None), dict(max_new_tokens=1024)),
        (dict(adv_estimator="reinforce++"), dict(num_return_sequences=1)),
        (dict(kl_target=0.1, kl_coef=0.02), {}),
    ],
)
def test_valid_choices_load_with_the_values_given(algo, rollout):
    cfg = config_from_dict({"algo": algo, "rollout": rollout})
    for key, value in algo.items():
        assert getattr(cfg.algo, key) == value, key
        assert type(getattr(cfg.algo, key)) is type(value), key
    untouched = config_from_dict({}).algo.model_dump()
    for key, value in cfg.algo.model_dump().items():
        if key not in algo:
            assert value == untouched[key], key


def test_an_int_is_stored_as_a_float_and_the_message_shows_the_float():
    assert config_from_dict({"algo": {"gamma": 1}}).algo.gamma == 1.0
    assert type(config_from_dict({"algo": {"gamma": 1}}).algo.gamma) is float
    with pytest.raises(ConfigError) as e:
        config_from_dict({"algo": {"gamma": 2}})
    assert str(e.value) == "algo.gamma: must be in [0, 1], got 2.0"


ADV = "['grpo', 'dr_grpo', 'rloo', 'gae', 'reinforce++', 'reinforce++-baseline', 'gigpo']"
AGG = "['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm']"


@pytest.mark.parametrize(
    "algo, rollout, message",
    [
        (
            dict(adv_estimator="gae"),
            {},
            "algo.critic: algo.adv_estimator gae needs true, got false (GAE's baseline is a "
            "learned value model; Schulman et al. 2016)",
        ),
        (
            dict(critic=True),
            {},
            "algo.adv_estimator: algo.critic true needs gae, got grpo (no other estimator "
            "reads the value model)",
        ),
        (dict(adv_estimator="gpro"), {}, f"algo.adv_estimator: must be one of {ADV}, got 'gpro'"),
        (
            dict(policy_loss="ppo2"),
            {},
            "algo.policy_loss: must be one of ['ppo', 'gspo', 'cispo', 'topr', 'reinforce'], "
            "got 'ppo2'",
        ),
        (dict(is_mode="clip"), {}, "algo.is_mode: must be one of ['truncate', 'mask'], got 'clip'"),
        (
            dict(is_level="seq"),
            {},
            "algo.is_level: must be one of ['token', 'sequence', 'geometric'], got 'seq'",
        ),
        (
            dict(kl_estimator="low_var_kl"),
            {},
            "algo.kl_estimator: must be one of ['k1', 'k2', 'k3'], got 'low_var_kl'",
        ),
        (dict(loss_agg_mode="mean"), {}, f"algo.loss_agg_mode: must be one of {AGG}, got 'mean'"),
        (
            dict(reward_norm="zscore"),
            {},
            "algo.reward_norm: must be one of ['none', 'batch', 'group', 'running'], got 'zscore'",
        ),
        (dict(clip_low=1.5), {}, "algo.clip_low: must be in (0, 1], got 1.5"),
        (dict(clip_low=0.0), {}, "algo.clip_low: must be in (0, 1], got 0.0"),
        (dict(clip_high=-0.1), {}, "algo.clip_high: must be > 0, got -0.1"),
        (dict(dual_clip_c=1.0), {}, "algo.dual_clip_c: must be > 1 or null, got 1.0"),
        (dict(tis_cap=0.5), {}, "algo.tis_cap: must be >= 1 or null, got 0.5"),
        (
            dict(is_low=0.5),
            {},
            "algo.is_mode: algo.is_low 0.5 needs mask, got truncate (is_low is the lower edge "
            "of the interval mask mode keeps)",
        ),
        (dict(is_mode="mask", is_low=1.5), {}, "algo.is_low: must be in [0, 1] or null, got 1.5"),
        (dict(kl_coef=-0.1), {}, "algo.kl_coef: must be >= 0, got -0.1"),
        (dict(entropy_coef=-1.0), {}, "algo.entropy_coef: must be >= 0, got -1.0"),
        (dict(norm_len=0), {}, "algo.norm_len: must be > 0 or null, got 0.0"),
        (dict(gamma=1.5), {}, "algo.gamma: must be in [0, 1], got 1.5"),
        (dict(lam=-0.1), {}, "algo.lam: must be in [0, 1], got -0.1"),
        (dict(clip_range_value=0.0), {}, "algo.clip_range_value: must be > 0 or null, got 0.0"),
        (dict(reward_clip=-1.0), {}, "algo.reward_clip: must be > 0 or null, got -1.0"),
        (
            dict(overlong_penalty_factor=0.0),
            {},
            "algo.overlong_penalty_factor: must be > 0, got 0.0",
        ),
        (dict(overlong_buffer=0), {}, "algo.overlong_buffer: must be > 0 or null, got 0"),
        (dict(overlong_buffer=2.5), {}, "algo.overlong_buffer: expected an integer, got 2.5"),
        (
            dict(overlong_buffer=1024),
            dict(max_new_tokens=1024),
            "algo.overlong_buffer: must be < max_new_tokens (1024), got 1024",
        ),
        (
            {},
            dict(num_return_sequences=1),
            "rollout.num_return_sequences: algo.adv_estimator grpo needs >= 2, got 1 (the "
            "baseline is the other samples of the prompt's group)",
        ),
        (
            dict(adv_estimator="reinforce++", dynamic_sampling=True),
            dict(num_return_sequences=1),
            "rollout.num_return_sequences: algo.dynamic_sampling true needs >= 2, got 1 (a "
            "group of one always has equal scores and would always be dropped)",
        ),
        (dict(gamma=float("inf")), {}, "algo.gamma: must be finite, got inf"),
        (dict(kl_coef=True), {}, "algo.kl_coef: expected a number, got True"),
        (dict(critic="yes"), {}, "algo.critic: expected true or false, got 'yes'"),
        (
            dict(kl_target=0.1),
            {},
            "algo.kl_coef: algo.kl_target 0.1 needs > 0.0, got 0.0 (the adaptive controller "
            "starts from it; InstructGPT: 0.02)",
        ),
    ],
)
def test_errors_are_one_line_naming_the_key(algo, rollout, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algo": algo, "rollout": rollout})
    assert str(info.value) == message
