"""The rules that tie the `algo:` keys together (and to `rollout:`), as one table: `RULES`.

A rule reads "when these keys hold these values, that key needs one of those": `algo.policy_loss:
gspo` needs `algo.loss_agg_mode: seq-mean-token-mean`. The losses, estimators, aggregation modes,
IS levels and IS modes alone multiply to 840 combinations; the table says, in one place, which of
them contradict what their names mean (level `error`: the config is refused, one line naming
every key involved, all broken rules joined by `;`) and which are legal but unusual or without
effect (level `warn`: one line each, logged when the config is loaded). The named recipes
(broker/config/config_recipes.py) add one error rule per key that defines them, so `algo.recipe: gspo`
beside `algo.policy_loss: ppo` is refused too. docs/algorithms.md lists the table
(`rules_markdown`, written by scripts/gen_config_docs.py).

Rules are checked on the loaded values, whatever set them (a recipe, the user, a default), once
every section has passed its own bounds (`check_rules`, called by the root `Config`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollflash.broker.config.config_algo import CRITIC_ESTIMATORS, GROUP_BASELINES, AlgoConfig
from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_recipes import RECIPES, recipe_value, recipes_markdown, shown
from rollflash.broker.config.config_sections import RolloutConfig

log = logging.getLogger(__name__)


class RuleSections(Protocol):
    """The sections the rules read (the root `Config` has them): `algo:` and `rollout:`."""

    @property
    def algo(self) -> AlgoConfig: ...

    @property
    def rollout(self) -> RolloutConfig: ...


@dataclass(frozen=True)
class Values:
    """Some values of one key, and how messages and the docs name them."""

    text: str
    holds: Callable[[Any], bool]


def one_of(*values: Any) -> Values:
    return Values(" or ".join(shown(v) for v in values), lambda v: v in values)


def above(bound: float) -> Values:
    return Values(f"> {shown(bound)}", lambda v: v > bound)


def at_least(bound: int) -> Values:
    return Values(f">= {bound}", lambda v: v >= bound)


def at_most(bound: float) -> Values:
    return Values(f"<= {shown(bound)}", lambda v: v <= bound)


def none_of(*values: Any) -> Values:
    return Values(f"not {' or '.join(shown(v) for v in values)}", lambda v: v not in values)


SET = Values("set", lambda v: v is not None)
NULL = one_of(None)
TRUE = one_of(True)


@dataclass(frozen=True)
class Rule:
    when: tuple[tuple[str, Values], ...]  # dotted keys and the values that make the rule apply
    key: str  # the dotted key the rule constrains
    needs: Values  # what `key` must hold when the rule applies
    why: str  # the reason, with its source
    level: Literal["error", "warn"] = "error"

    def broken(self, cfg: RuleSections) -> bool:
        applies = all(values.holds(_get(cfg, k)) for k, values in self.when)
        return applies and not self.needs.holds(_get(cfg, self.key))

    def message(self, cfg: RuleSections) -> str:
        """`algo.loss_agg_mode: algo.policy_loss gspo needs seq-mean-token-mean, got token-mean
        (why)`; a value that came with the recipe says so."""
        verb = "needs" if self.level == "error" else "is usually run with"
        cause = " with ".join(_named(cfg, k) for k, _ in self.when)
        got = shown(_get(cfg, self.key))
        return f"{self.key}: {cause} {verb} {self.needs.text}, got {got} ({self.why})"


def _get(cfg: RuleSections, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _named(cfg: RuleSections, key: str) -> str:
    """`algo.policy_loss gspo`, with `(algo.recipe gspo)` when the recipe holds that value."""
    value, recipe = _get(cfg, key), cfg.algo.recipe
    text = f"{key} {shown(value)}"
    section, name = key.split(".")
    if recipe is not None and section == "algo" and name != "recipe":
        if name in RECIPES[recipe].sets and recipe_value(recipe, name, cfg.rollout) == value:
            text += f" (algo.recipe {recipe})"
    return text


GSPO = (("algo.policy_loss", one_of("gspo")),)
KL_IN_REWARD = (("algo.use_kl_in_reward", TRUE),)

# fmt: off
RULES: tuple[Rule, ...] = (
    # what the estimators need
    Rule((("algo.adv_estimator", one_of(*sorted(CRITIC_ESTIMATORS))),), "algo.critic", TRUE,
         "GAE's baseline is a learned value model; Schulman et al. 2016"),
    Rule((("algo.critic", TRUE),), "algo.adv_estimator", one_of(*sorted(CRITIC_ESTIMATORS)),
         "no other estimator reads the value model"),
    Rule((("algo.adv_estimator", one_of(*sorted(GROUP_BASELINES))),),
         "rollout.num_return_sequences", at_least(2),
         "the baseline is the other samples of the prompt's group"),
    Rule((("algo.dynamic_sampling", TRUE),), "rollout.num_return_sequences", at_least(2),
         "a group of one always has equal scores and would always be dropped"),
    # what the losses mean
    Rule(GSPO, "algo.loss_agg_mode", one_of("seq-mean-token-mean"),
         "GSPO weighs every response equally whatever its length: Zheng et al. 2025, eq. 5"),
    Rule(GSPO, "algo.is_level", one_of("geometric", "sequence"),
         "a per-token off-policy weight breaks GSPO's sequence-level ratio: Zheng et al. 2025, "
         "eq. 7"),
    Rule(GSPO, "algo.dual_clip_c", NULL, "GSPO clips the sequence ratio only", "warn"),
    Rule(GSPO, "algo.clip_low", at_most(0.01),
         "GSPO's ratio is a per-token geometric mean; the paper clips at 3e-4 / 4e-4, a "
         "token-scale range almost never binds: Zheng et al. 2025, Sec. 5.1", "warn"),
    Rule(GSPO, "algo.clip_high", at_most(0.01),
         "GSPO's ratio is a per-token geometric mean; the paper clips at 3e-4 / 4e-4, a "
         "token-scale range almost never binds: Zheng et al. 2025, Sec. 5.1", "warn"),
    Rule((("algo.adv_estimator", one_of("dr_grpo")),), "algo.loss_agg_mode",
         none_of("seq-mean-token-mean"),
         "dividing each response's loss by its own length is the bias Dr.GRPO removes: "
         "Liu et al. 2025, Sec. 3.1", "warn"),
    # the off-policy weight
    Rule((("algo.is_low", SET),), "algo.is_mode", one_of("mask"),
         "is_low is the lower edge of the interval mask mode keeps"),
    Rule((("algo.is_mode", one_of("mask")), ("algo.tis_cap", NULL)), "algo.is_low", SET,
         "mask mode without either bound drops no token", "warn"),
    # the KL term
    Rule((("algo.kl_target", SET),), "algo.kl_coef", above(0.0),
         "the adaptive controller starts from it; InstructGPT: 0.02"),
    Rule(KL_IN_REWARD, "algo.kl_coef", above(0.0), "a KL penalty of 0 has no effect", "warn"),
    Rule(KL_IN_REWARD, "algo.kl_estimator", one_of("k1", "k2"),
         "the reward penalty of InstructGPT (Ouyang et al. 2022, eq. 2), OpenRLHF and verl is "
         "k1, the log-ratio; k3 is GRPO's loss estimator", "warn"),
    Rule((("algo.kl_estimator", one_of("k1", "k2")),), "algo.kl_coef", above(0.0),
         "no KL term is computed at kl_coef 0", "warn"),
    # keys without effect in their company
    Rule((("algo.norm_len", SET),), "algo.loss_agg_mode", one_of("seq-mean-token-sum-norm"),
         "norm_len is the divisor of seq-mean-token-sum-norm only", "warn"),
    Rule((("algo.clip_range_value", SET),), "algo.critic", TRUE,
         "value clipping needs a value model", "warn"),
    Rule((("algo.whiten_advantages", TRUE),), "algo.adv_estimator",
         none_of("reinforce++", "reinforce++-baseline"),
         "REINFORCE++ whitens its advantages already: Hu 2025, Sec. 3", "warn"),
    Rule((("algo.overlong_penalty_factor", none_of(1.0)),), "algo.overlong_buffer", SET,
         "the factor scales the soft overlong penalty, which overlong_buffer switches on", "warn"),
    # each recipe's defining keys: a recipe with another value there is another algorithm
    *(
        Rule((("algo.recipe", one_of(name)),), f"algo.{key}", one_of(recipe.sets[key]),
             f"the key that makes the recipe {name}; drop algo.recipe to combine freely")
        for name, recipe in RECIPES.items()
        for key in recipe.defines
    ),
)
# fmt: on


def check_rules(cfg: RuleSections) -> None:
    """Raise one ConfigError naming every broken error rule; log each broken warn rule."""
    broken = [rule for rule in RULES if rule.broken(cfg)]
    errors = [rule.message(cfg) for rule in broken if rule.level == "error"]
    if errors:
        raise ConfigError("; ".join(errors))
    for rule in broken:
        log.warning("%s", rule.message(cfg))


def rules_markdown() -> list[str]:
    """The table of docs/algorithms.md: every rule, the refusals first."""
    lines = ["| when | then | level | why |", "|---|---|---|---|"]
    for rule in sorted(RULES, key=lambda r: r.level):
        if rule.when[0][0] == "algo.recipe":
            continue  # the recipes' own rules: the recipe table lists their defining keys
        when = " and ".join(f"`{k}` {v.text}" for k, v in rule.when)
        then = f"`{rule.key}` {rule.needs.text}"
        lines.append(f"| {when} | {then} | {rule.level} | {rule.why} |")
    return lines


ALGO_DOC_BEGIN = "<!-- recipes and rules: written by scripts/gen_config_docs.py -->"
ALGO_DOC_END = "<!-- end of recipes and rules -->"


def algorithms_block() -> str:
    """The generated part of docs/algorithms.md: the recipe table, then the rule table."""
    lines = [ALGO_DOC_BEGIN, "", *recipes_markdown(), "", *rules_markdown(), "", ALGO_DOC_END]
    return "\n".join(lines)


def with_algorithms_block(doc: str) -> str:
    """docs/algorithms.md with its generated block replaced by `algorithms_block()`."""
    head, rest = doc.split(ALGO_DOC_BEGIN, 1)
    return head + algorithms_block() + rest.split(ALGO_DOC_END, 1)[1]
