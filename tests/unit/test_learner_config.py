"""The `algo:` section: every registry name is selectable, impossible combinations fail at load with
the key named, and the shipped algorithm configs mean what their names say."""

import typing
from pathlib import Path

import pytest

from rollflash import algos
from rollflash.broker.config.config import AlgoConfig, ConfigError, config_from_dict, load_config
from rollflash.broker.config.config_algo import CRITIC_ESTIMATORS, GROUP_BASELINES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "field, registry",
    [
        ("adv_estimator", algos.ADVANTAGE_ESTIMATORS),
        ("policy_loss", algos.POLICY_LOSSES),
        ("loss_agg_mode", algos.AGG_MODES),
        ("is_mode", algos.IS_MODES),
        ("is_level", algos.IS_LEVELS),
        ("kl_estimator", algos.KL_ESTIMATORS),
        ("reward_norm", algos.REWARD_NORMS),
    ],
)
def test_config_literals_are_exactly_the_registry_names(field, registry):
    # the config spells the names out (no torch import at load); this keeps the two in step
    assert set(typing.get_args(typing.get_type_hints(AlgoConfig)[field])) == set(registry)


def test_config_estimator_sets_are_exactly_the_registry_names():
    assert CRITIC_ESTIMATORS == algos.CRITIC_ESTIMATORS
    # every estimator is either group-based or fine with one sample per prompt (gae: critic
    # baseline; reinforce++: batch baseline)
    assert GROUP_BASELINES <= set(algos.ADVANTAGE_ESTIMATORS)
    assert set(algos.ADVANTAGE_ESTIMATORS) - GROUP_BASELINES == {"gae", "reinforce++"}


def test_defaults_are_grpo_with_ppo_clip_and_tis_cap_2():
    a = config_from_dict({}).algo
    assert (a.adv_estimator, a.policy_loss, a.tis_cap, a.loss_agg_mode) == (
        "grpo",
        "ppo",
        2.0,
        "token-mean",
    )
    assert (a.critic, a.kl_coef, a.entropy_coef, a.dynamic_sampling) == (False, 0.0, 0.0, False)


@pytest.mark.parametrize(
    "algo, message",
    [
        (
            {"adv_estimator": "gae"},
            "algo.critic: algo.adv_estimator gae needs true, got false",
        ),
        (
            {"adv_estimator": "vtrace"},
            "algo.adv_estimator: must be one of ['grpo', 'dr_grpo', 'rloo'",
        ),
        ({"clip_low": 1.5}, "algo.clip_low: must be in (0, 1], got 1.5"),
        ({"clip_low": 0}, "algo.clip_low: must be in (0, 1], got 0.0"),
        ({"critic": True}, "algo.adv_estimator: algo.critic true needs gae, got grpo"),
        (
            {"policy_loss": "dpo"},
            "algo.policy_loss: must be one of ['ppo', 'gspo', 'cispo', 'topr',",
        ),
        ({"gamma": 1.5}, "algo.gamma: must be in [0, 1], got 1.5"),
        ({"is_low": 0.5}, "algo.is_mode: algo.is_low 0.5 needs mask, got truncate"),
        ({"dual_clip_c": 0.5}, "algo.dual_clip_c: must be > 1"),
        ({"kl_coef": -0.1}, "algo.kl_coef: must be >= 0"),
        ({"overlong_buffer": 8}, "algo.overlong_buffer: must be < max_new_tokens (8), got 8"),
        ({"critic_lr": 0, "adv_estimator": "gae", "critic": True}, "algo.critic_lr: must be > 0"),
        ({"norm_len": -1}, "algo.norm_len: must be > 0"),
        ({"overlong_filter": "yes"}, "algo.overlong_filter: expected true or false"),
    ],
)
def test_impossible_algo_choices_fail_at_load_naming_the_key(algo, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"rollout": {"max_new_tokens": 8}, "algo": algo})
    assert str(e.value).startswith(message), str(e.value)


def test_group_baselines_and_dynamic_sampling_need_two_samples_per_prompt():
    for algo in (
        {"adv_estimator": "rloo"},
        {"adv_estimator": "reinforce++", "dynamic_sampling": True},
    ):
        with pytest.raises(ConfigError, match=r"^rollout\.num_return_sequences: "):
            config_from_dict({"rollout": {"num_return_sequences": 1}, "algo": algo})
    # REINFORCE++ without a group baseline is fine with one sample per prompt
    config_from_dict(
        {"rollout": {"num_return_sequences": 1}, "algo": {"adv_estimator": "reinforce++"}}
    )


def test_shipped_algorithm_configs_select_what_their_names_say():
    ppo = load_config(ROOT / "configs" / "ppo_gae.yaml").algo
    assert (ppo.adv_estimator, ppo.critic, ppo.policy_loss) == ("gae", True, "ppo")
    dapo = load_config(ROOT / "configs" / "dapo.yaml").algo
    assert dapo.recipe == "dapo" and dapo.clip_high > dapo.clip_low and dapo.dynamic_sampling
    assert dapo.loss_agg_mode == "token-mean" and dapo.overlong_buffer is not None
