"""The `algo:` section of the run config; docs/algorithms.md gives each key's formula and paper.

The names of the enumerations are the keys of the algos registries, written out so that loading a
config does not import torch (tests/unit/test_learner_config.py checks that they match), and the
recipe names are those of broker/config/config_recipes.py. The rules that tie keys of this section
together, and to `rollout:`, are one table, broker/config/config_rules.py, which the root config checks.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt

from rollflash.broker.config.config_sections import Number, Section

# advantage estimators that need a value model (algos.CRITIC_ESTIMATORS)
CRITIC_ESTIMATORS = frozenset({"gae"})
# advantage estimators whose baseline comes from the other samples of the group
GROUP_BASELINES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce++-baseline", "gigpo"})


class AlgoConfig(Section):
    """The `algo:` section: advantage estimator, policy loss, off-policy correction, KL, shaping."""

    recipe: (
        Literal[
            "grpo",
            "dr_grpo",
            "dapo",
            "gspo",
            "cispo",
            "ppo",
            "reinforce++",
            "reinforce++-baseline",
            "rloo",
            "gigpo",
        ]
        | None
    ) = Field(
        None,
        description="named algorithm: sets the keys docs/algorithms.md lists for it; keys "
        "given beside it win, except one that contradicts it (refused)",
    )
    adv_estimator: Literal[
        "grpo", "dr_grpo", "rloo", "gae", "reinforce++", "reinforce++-baseline", "gigpo"
    ] = Field(
        "grpo",
        description="advantage estimator (algos.ADVANTAGE_ESTIMATORS); gae needs critic: true; "
        "gigpo (step-level, multi-turn environments only) discounts turns by gamma",
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "topr", "reinforce"] = Field(
        "ppo", description="policy loss (algos.POLICY_LOSSES)"
    )
    clip_low: Number = Field(
        0.2, gt=0, le=1, description="ratio lower bound 1 - clip_low (1: no lower bound)"
    )
    clip_high: Number = Field(0.2, gt=0, description="ratio upper bound 1 + clip_high (DAPO: 0.28)")
    dual_clip_c: Number | None = Field(
        3.0, gt=1, description="dual-clip bound for negative advantages (null = off)"
    )
    tis_cap: Number | None = Field(
        2.0,
        ge=1,
        description="cap of the importance weight pi_prox / pi_behaviour (null = off)",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="cap the IS weight, or drop tokens outside bounds"
    )
    is_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="what the IS weight is a ratio of"
    )
    is_low: Number | None = Field(
        None,
        ge=0,
        le=1,
        description="lower edge of the kept IS interval with is_mode: mask (IcePop: 0.5)",
    )
    kl_coef: Number = Field(
        0.0,
        ge=0,
        description="weight of the KL to the frozen initial policy (0 = no reference model)",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token KL estimator (algos.KL_ESTIMATORS)"
    )
    use_kl_in_reward: StrictBool = Field(
        False, description="subtract kl_coef * KL from token rewards instead of a loss term"
    )
    entropy_coef: Number = Field(
        0.0, ge=0, description="weight of the entropy bonus (0: entropy is logged, not in the loss)"
    )
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="how token losses are averaged (algos.AGG_MODES)")
    norm_len: Number | None = Field(
        None,
        gt=0,
        description="divisor of seq-mean-token-sum-norm (null = rollout.max_new_tokens)",
    )
    whiten_advantages: StrictBool = Field(
        False, description="z-score advantages over the batch's response tokens (as ROLL)"
    )
    gamma: Number = Field(1.0, ge=0, le=1, description="per-token discount (gae, reinforce++)")
    lam: Number = Field(0.95, ge=0, le=1, description="GAE lambda")
    critic: StrictBool = Field(
        False,
        description="train a value model (policy backbone + scalar head); needed by gae only",
    )
    critic_lr: Number = Field(1e-4, gt=0, description="AdamW learning rate of the critic")
    clip_range_value: Number | None = Field(
        None, gt=0, description="value clipping around the old values (null = unclipped)"
    )
    reward_clip: Number | None = Field(
        None, gt=0, description="clamp scores to [-reward_clip, reward_clip] (null = off)"
    )
    reward_norm: Literal["none", "batch", "group", "running"] = Field(
        "none", description="z-scoring of the scores (algos.REWARD_NORMS)"
    )
    dynamic_sampling: StrictBool = Field(
        False, description="drop groups whose scores are all equal (DAPO)"
    )
    overlong_filter: StrictBool = Field(
        False, description="mask truncated samples out of the loss (DAPO)"
    )
    overlong_buffer: StrictInt | None = Field(
        None,
        gt=0,
        description="soft overlong penalty over the budget's last N tokens (null = off); "
        "must be < rollout.max_new_tokens",
    )
    overlong_penalty_factor: Number = Field(
        1.0, gt=0, description="scale of the soft overlong penalty"
    )
    kl_target: Number | None = Field(
        None,
        gt=0,
        description="adaptive kl_coef aiming at this per-token KL (null = fixed kl_coef)",
    )
    kl_horizon: Number = Field(
        10000.0,
        gt=0,
        description="samples over which the adaptive kl_coef moves by up to 20%",
    )
