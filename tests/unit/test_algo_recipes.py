"""`algo.recipe` and the rule table (broker/config/config_recipes.py,
broker/config/config_rules.py): each recipe loads, sets exactly its keys and trains through the
learner's loss path as those keys written out do; combinations that contradict a loss are refused
naming the keys; unusual ones warn once."""

from __future__ import annotations

import itertools
import logging
import math
import typing

import pytest
import yaml

from rollflash import algos
from rollflash.broker.config.config import AlgoConfig, ConfigError, config_from_dict, load_config
from rollflash.broker.config.config_recipes import RECIPES, OfBudget
from rollflash.broker.config.config_rules import RULES
from rollflash.learner.step.prepare import build_algo_models
from rollflash.learner.step.train import train_step
from tests.unit.test_learner_train import MIXED, _cfg, _fresh, _groups

RULES_LOG = "rollflash.broker.config.config_rules"
# the learner test's groups and one whose samples all score the same (dynamic sampling drops it)
GROUPS = [*MIXED, [("14", 1.0, True)] * 4]


def _load(algo: dict, rollout: dict | None = None):
    return config_from_dict({"algo": algo, "rollout": rollout or {}})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RULES_LOG]


def test_recipe_names_are_the_config_literal():
    hint = typing.get_type_hints(AlgoConfig)["recipe"]
    (literal, none) = typing.get_args(hint)
    assert none is type(None) and set(typing.get_args(literal)) == set(RECIPES)


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_loads_with_its_keys_and_no_warning(name, caplog):
    with caplog.at_level(logging.WARNING, logger=RULES_LOG):
        cfg = _load({"recipe": name}, {"max_new_tokens": 2048})
    assert _warnings(caplog) == []  # a recipe is never unusual
    defaults = _load({}).algo.model_dump()
    for key, value in cfg.algo.model_dump().items():
        if key == "recipe":
            assert value == name
        elif key in RECIPES[name].sets:
            wanted = RECIPES[name].sets[key]
            # the budget share: 2048 // 5 = 409 (DAPO: 4096 of 20480, one fifth)
            assert value == (409 if isinstance(wanted, OfBudget) else wanted), key
        else:
            assert value == defaults[key], key


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_trains_as_its_keys_written_out(tiny, name):
    # the learner's loss path: one train_step of the tiny model on the same groups with the
    # recipe, with the keys it sets written out, and with the defaults. The first two are the
    # same computation (equal to the last bit); the defaults train differently, so the recipe
    # switches what is learned.
    model_dir, tok = tiny
    with_recipe = _cfg(model_dir, {"recipe": name}, micro=5)
    written = {k: v for k, v in with_recipe.algo.model_dump().items() if k != "recipe"}
    results = []
    for algo in ({"recipe": name}, written, {}):
        cfg = _cfg(model_dir, algo, micro=5)
        model, opt = _fresh(model_dir)
        groups = _groups(model, tok, GROUPS, behav_shift=0.05)
        metrics = train_step(model, opt, groups, cfg, build_algo_models(cfg))
        assert metrics["optim/skipped"] == 0.0
        assert all(math.isfinite(v) for v in metrics.values())
        results.append(metrics)
    recipe, explicit, default = results
    assert recipe == explicit
    assert recipe["loss/policy"] != default["loss/policy"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoTokenizer

    return tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_keys_beside_a_recipe_win_unless_they_define_it():
    cfg = _load({"recipe": "dapo", "clip_high": 0.3, "overlong_buffer": None})
    assert (cfg.algo.clip_high, cfg.algo.overlong_buffer) == (0.3, None)
    assert cfg.algo.dynamic_sampling and cfg.algo.dual_clip_c is None  # the rest is the recipe's
    with pytest.raises(ConfigError) as e:
        _load({"recipe": "dapo", "loss_agg_mode": "seq-mean-token-mean"})
    assert str(e.value) == (
        "algo.loss_agg_mode: algo.recipe dapo needs token-mean, got seq-mean-token-mean (the key "
        "that makes the recipe dapo; drop algo.recipe to combine freely)"
    )
    # Dr.GRPO without its length fix is refused with the recipe, warned about without it
    with pytest.raises(ConfigError, match=r"^algo\.loss_agg_mode: algo\.recipe dr_grpo needs "):
        _load({"recipe": "dr_grpo", "loss_agg_mode": "seq-mean-token-mean"})


def test_gspo_with_token_mean_is_refused_naming_the_keys():
    with pytest.raises(ConfigError) as e:
        _load({"recipe": "gspo", "loss_agg_mode": "token-mean"})
    assert str(e.value) == (
        "algo.loss_agg_mode: algo.policy_loss gspo (algo.recipe gspo) needs "
        "seq-mean-token-mean, got token-mean (GSPO weighs every response equally whatever its "
        "length: Zheng et al. 2025, eq. 5)"
    )
    with pytest.raises(ConfigError, match=r"^algo\.is_level: algo\.policy_loss gspo needs "):
        _load({"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"})
    # the loss alone, on the defaults: both contradictions, in one line
    with pytest.raises(ConfigError) as e:
        _load({"policy_loss": "gspo"})
    message = str(e.value)
    assert "\n" not in message and message.count("; ") == 1
    assert message.startswith("algo.loss_agg_mode: algo.policy_loss gspo needs")
    assert (
        "; algo.is_level: algo.policy_loss gspo needs geometric or sequence, got token" in message
    )


def test_a_bad_recipe_name_is_refused():
    with pytest.raises(ConfigError) as e:
        _load({"recipe": "ppo2"})
    assert str(e.value).startswith("algo.recipe: must be one of ['grpo', 'dr_grpo', 'dapo',")
    assert str(e.value).endswith("or null, got 'ppo2'")


# one hand-made config per warn rule: (algo, the keys its warnings name, one line each)
WARNED = [
    ({"recipe": "gspo", "dual_clip_c": 3.0}, ["algo.dual_clip_c"]),
    ({"recipe": "gspo", "clip_low": 0.2}, ["algo.clip_low"]),
    ({"recipe": "gspo", "clip_high": 0.2}, ["algo.clip_high"]),
    ({"adv_estimator": "dr_grpo", "loss_agg_mode": "seq-mean-token-mean"}, ["algo.loss_agg_mode"]),
    ({"is_mode": "mask", "tis_cap": None}, ["algo.is_low"]),
    # a KL penalty at kl_coef 0: neither the penalty nor the k1 estimator acts
    ({"use_kl_in_reward": True, "kl_estimator": "k1"}, ["algo.kl_coef", "algo.kl_coef"]),
    ({"use_kl_in_reward": True, "kl_coef": 0.1}, ["algo.kl_estimator"]),
    ({"kl_estimator": "k2"}, ["algo.kl_coef"]),
    ({"norm_len": 512.0}, ["algo.loss_agg_mode"]),
    ({"clip_range_value": 0.2}, ["algo.critic"]),
    ({"adv_estimator": "reinforce++", "whiten_advantages": True}, ["algo.adv_estimator"]),
    ({"overlong_penalty_factor": 0.5}, ["algo.overlong_buffer"]),
]


@pytest.mark.parametrize("algo, keys", WARNED)
def test_an_unusual_combination_warns_once_in_one_line(algo, keys, caplog):
    with caplog.at_level(logging.WARNING, logger=RULES_LOG):
        _load(algo)
    lines = _warnings(caplog)
    assert [line.split(": ")[0] for line in lines] == keys
    assert len(set(lines)) == len(lines)  # each once
    assert all(" is usually run with " in line and "\n" not in line for line in lines)


def test_every_warn_rule_has_its_case():
    fired = set()
    for algo, _ in WARNED:
        cfg = _load(algo)
        fired |= {rule for rule in RULES if rule.level == "warn" and rule.broken(cfg)}
    assert fired == {rule for rule in RULES if rule.level == "warn"}


def test_the_840_combinations_load_except_those_contradicting_gspo():
    # 5 losses x 7 estimators x 4 aggregation modes x 3 IS levels x 2 IS modes = 840; GSPO with
    # another mode than seq-mean-token-mean or with token-level IS is refused:
    # 7 x 2 x (4 x 3 - 1 x 2) = 140 of the 168 GSPO combinations
    axes = [
        algos.POLICY_LOSSES,
        algos.ADVANTAGE_ESTIMATORS,
        algos.AGG_MODES,
        algos.IS_LEVELS,
        algos.IS_MODES,
    ]
    combos = list(itertools.product(*axes))
    refused = []
    for loss, estimator, agg, level, mode in combos:
        algo = {
            "policy_loss": loss,
            "adv_estimator": estimator,
            "critic": estimator in algos.CRITIC_ESTIMATORS,
            "loss_agg_mode": agg,
            "is_level": level,
            "is_mode": mode,
        }
        try:
            _load(algo)
        except ConfigError as e:
            refused.append((loss, agg, level, str(e)))
    assert len(combos) == 840 and len(refused) == 140
    for loss, agg, level, message in refused:
        assert loss == "gspo" and (agg != "seq-mean-token-mean" or level == "token")
        named = {part.split(":")[0] for part in message.split("; ")}
        wanted = {"algo.loss_agg_mode"} if agg != "seq-mean-token-mean" else set()
        wanted |= {"algo.is_level"} if level == "token" else set()
        assert named == wanted and "algo.policy_loss gspo" in message


def test_a_resolved_recipe_loads_back_to_itself(tmp_path):
    cfg = load_config(None, ["algo.recipe=dapo", "algo.clip_high=0.3"])
    cfg.save(tmp_path / "run.yaml")
    again = load_config(tmp_path / "run.yaml")
    assert again.algo == cfg.algo
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["algo"]["recipe"] == "dapo"
