"""Named algorithm recipes (`algo.recipe`): the `algo:` keys a paper's algorithm sets together.

`algo.recipe: gspo` sets the loss, its aggregation, its off-policy weight level and its clip
range at once, as the paper gives them; writing `policy_loss: gspo` alone sets the loss only.
Keys written beside a recipe win over the recipe's values (`recipe: dapo` with `clip_high: 0.3`
trains DAPO with another clip-higher), except the keys that define it (`Recipe.defines`: the
loss, estimator or aggregation the recipe is named for): another value there is refused, as is
any value that contradicts the loss (broker/config/config_rules.py). The values fill the `algo:`
mapping before it is validated, so the resolved config (`rollctl config show`, the run
directory's copy) lists every key a recipe set, and loading that copy again changes nothing.

A value that depends on the generation budget (DAPO's overlong buffer) is an `OfBudget`, worked
out from `rollout.max_new_tokens`. docs/algorithms.md lists the recipes (`recipes_markdown`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollflash.broker.config.config_errors import ConfigError

if TYPE_CHECKING:
    from rollflash.broker.config.config_sections import RolloutConfig


def shown(value: Any) -> str:
    """A config value as YAML writes it: null, true, 0.0003, token-mean."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class OfBudget:
    """A share of `rollout.max_new_tokens`, at least one token."""

    divisor: int

    def of(self, max_new_tokens: int) -> int:
        return max(1, max_new_tokens // self.divisor)

    def __str__(self) -> str:
        return f"max_new_tokens / {self.divisor}"


@dataclass(frozen=True)
class Recipe:
    sets: dict[str, Any]  # algo keys and their values
    defines: tuple[str, ...]  # keys whose value makes it this algorithm: never overridden
    paper: str  # where the values come from
    notes: str = field(default="")  # where a value is ours rather than the paper's


# the clipped surrogate, no dual clip, a per-token off-policy weight: what most recipes share
_PPO = {"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None}
_TOKEN_IS = {"is_level": "token"}
_NO_KL = {"kl_coef": 0.0}

# fmt: off
RECIPES: dict[str, Recipe] = {
    "grpo": Recipe(
        {"adv_estimator": "grpo", **_PPO, "loss_agg_mode": "seq-mean-token-mean", **_TOKEN_IS,
         "kl_coef": 0.04, "kl_estimator": "k3", "use_kl_in_reward": False},
        ("adv_estimator", "policy_loss"),
        "Shao et al. 2024, DeepSeekMath, Sec. 4.1 eq. 3 (beta 0.04: Sec. 4.2)",
    ),
    "dr_grpo": Recipe(
        {"adv_estimator": "dr_grpo", **_PPO, "loss_agg_mode": "seq-mean-token-sum-norm",
         **_TOKEN_IS, **_NO_KL},
        ("adv_estimator", "policy_loss", "loss_agg_mode"),
        "Liu et al. 2025, Understanding R1-Zero-Like Training, Sec. 3.1",
        "norm_len stays null: the constant divisor is the generation budget",
    ),
    "dapo": Recipe(
        {"adv_estimator": "grpo", **_PPO, "clip_high": 0.28, "loss_agg_mode": "token-mean",
         **_TOKEN_IS, **_NO_KL, "dynamic_sampling": True, "overlong_buffer": OfBudget(5),
         "overlong_penalty_factor": 1.0},
        ("policy_loss", "loss_agg_mode", "dynamic_sampling"),
        "Yu et al. 2025, DAPO, Sec. 3.1-3.4 (a 4096-token buffer of a 20480 budget: Sec. 4.1)",
    ),
    "gspo": Recipe(
        {"adv_estimator": "grpo", "policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
         "dual_clip_c": None, "loss_agg_mode": "seq-mean-token-mean", "is_level": "geometric",
         **_NO_KL},
        ("policy_loss",),
        "Zheng et al. 2025, Group Sequence Policy Optimization, eqs. 5-7, Sec. 5.1",
        "the off-policy weight is the geometric mean too, as the paper's ratio",
    ),
    "cispo": Recipe(
        {"adv_estimator": "grpo", "policy_loss": "cispo", "clip_low": 1.0, "clip_high": 0.28,
         "dual_clip_c": None, "loss_agg_mode": "token-mean", **_TOKEN_IS, **_NO_KL},
        ("policy_loss",),
        "MiniMax 2025, MiniMax-M1, Sec. 3.1 eqs. 4-5",
        "no lower bound on the weight, as the paper; its tuned upper bound is not published: "
        "0.28, DAPO's, as Trinity-RFT",
    ),
    "ppo": Recipe(
        {"adv_estimator": "gae", "critic": True, "gamma": 1.0, "lam": 0.95, **_PPO,
         "loss_agg_mode": "token-mean", **_TOKEN_IS, **_NO_KL, "clip_range_value": 0.2,
         "whiten_advantages": True},
        ("adv_estimator", "policy_loss"),
        "Schulman et al. 2017, PPO, eq. 7; Schulman et al. 2016, GAE, eq. 16",
        "gamma 1 and lambda 0.95 as OpenRLHF; value clipping and advantage whitening as "
        "OpenAI baselines (Andrychowicz et al. 2021)",
    ),
    "reinforce++": Recipe(
        {"adv_estimator": "reinforce++", **_PPO, "loss_agg_mode": "token-mean", **_TOKEN_IS,
         "gamma": 1.0, "kl_coef": 0.01, "kl_estimator": "k1", "use_kl_in_reward": True},
        ("adv_estimator",),
        "Hu 2025, REINFORCE++, Sec. 3",
        "beta 0.01 as OpenRLHF's examples",
    ),
    "reinforce++-baseline": Recipe(
        {"adv_estimator": "reinforce++-baseline", **_PPO, "loss_agg_mode": "token-mean",
         **_TOKEN_IS, "gamma": 1.0, "kl_coef": 0.001, "kl_estimator": "k2",
         "use_kl_in_reward": False},
        ("adv_estimator",),
        "Hu 2025, REINFORCE++, Sec. 3.3",
        "a k2 KL loss with beta 0.001 as OpenRLHF's example",
    ),
    "rloo": Recipe(
        {"adv_estimator": "rloo", "policy_loss": "reinforce", "dual_clip_c": None,
         "loss_agg_mode": "seq-mean-token-sum", **_TOKEN_IS, "kl_coef": 0.05,
         "kl_estimator": "k1", "use_kl_in_reward": True},
        ("adv_estimator",),
        "Ahmadian et al. 2024, Back to Basics, eq. 6 (REINFORCE on the whole response)",
        "beta 0.05 as TRL's RLOO",
    ),
    "gigpo": Recipe(
        {"adv_estimator": "gigpo", "gamma": 0.95, **_PPO, "loss_agg_mode": "token-mean",
         **_TOKEN_IS, **_NO_KL},
        ("adv_estimator",),
        "Feng et al. 2025, Group-in-Group Policy Optimization (gamma 0.95 per turn)",
    ),
}
# fmt: on


def recipe_value(name: str, key: str, rollout: RolloutConfig) -> Any:
    """The value recipe `name` gives `key`, worked out for this run's generation budget."""
    value = RECIPES[name].sets[key]
    return value.of(rollout.max_new_tokens) if isinstance(value, OfBudget) else value


def with_recipe(data: Any, default_budget: int) -> Any:
    """The raw config mapping with its recipe's values filled in where `algo:` has no key."""
    algo = data.get("algo") if isinstance(data, dict) else None
    if not isinstance(algo, dict) or algo.get("recipe") is None:
        return data
    name = algo["recipe"]
    if not isinstance(name, str) or name not in RECIPES:
        raise ConfigError(f"algo.recipe: must be one of {list(RECIPES)} or null, got {name!r}")
    rollout = data.get("rollout") or {}
    budget = rollout.get("max_new_tokens", default_budget) if isinstance(rollout, dict) else None
    filled = {}
    for key, value in RECIPES[name].sets.items():
        if isinstance(value, OfBudget):
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                continue  # a bad budget is refused by rollout's own bound
            value = value.of(budget)
        filled[key] = value
    return {**data, "algo": {**filled, **algo}}


def recipes_markdown() -> list[str]:
    """The recipe table of docs/algorithms.md: each recipe, every key it sets, its paper."""
    lines = ["| recipe | keys it sets (defining keys in bold) | paper |", "|---|---|---|"]
    for name, recipe in RECIPES.items():
        keys = ", ".join(
            f"**`{k}: {shown(v)}`**" if k in recipe.defines else f"`{k}: {shown(v)}`"
            for k, v in recipe.sets.items()
        )
        paper = f"{recipe.paper}; {recipe.notes}" if recipe.notes else recipe.paper
        lines.append(f"| `{name}` | {keys} | {paper} |")
    return lines
