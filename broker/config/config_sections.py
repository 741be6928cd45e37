"""The sections of the run config (`rollout:`, `trainer:`, ...) other than `run:` and `redis:`
(broker/config/config_run.py) and `algo:`.

Each field's type, bounds and one-line description are the single source of truth: the loader
(broker/config/config.py) turns a violated bound into the one-line `ConfigError`, and the descriptions are
the reference for docs. Types are strict: an integer field refuses 2.5 and `true`, a number field
takes an integer (stored as a float) but refuses strings, booleans, `.inf` and `.nan`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from rollflash.broker.config.config_base import Number, Section
from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_gpu import TrainerGpuKeys, VLLMConfig
from rollflash.broker.config.config_reward import CodeRewardConfig, JudgeConfig


class TaskConfig(Section):
    name: StrictStr = Field("arithmetic", description="a task from envs.catalog")
    params: dict[Any, Any] = Field(
        default_factory=dict, description="passed to the task's constructor"
    )


class RolloutConfig(Section):
    engine: Literal["hf", "vllm", "sim"] = Field(
        "hf", description="inference engine of the generators"
    )
    num_return_sequences: StrictInt = Field(
        8, gt=0, description="samples per prompt: the GRPO group size"
    )
    max_new_tokens: StrictInt = Field(8, gt=0, description="response length limit")
    temperature: Number = Field(
        1.0, gt=0, description="sampling temperature (the learner scales logits by it too)"
    )
    top_p: Number = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")
    prompts_per_pull: StrictInt = Field(
        4, gt=0, description="prompts a generator claims and samples as one batch"
    )
    inflight_samples: StrictInt = Field(
        0,
        ge=0,
        description="> 0: continuous batching instead of pulls: up to this many samples "
        "decoding, new prompts claimed as their slots free up",
    )
    num_rollout_workers: StrictInt = Field(
        2,
        ge=0,
        description="generator processes started by `rollctl run` (when unset: from the GPUs, "
        "or on a CPU from the cores and the model size)",
    )
    heartbeat_ttl_s: Number = Field(
        30.0,
        gt=0,
        description="a generator's status hash expires this long after its last beat; a "
        "floor: raised to 3x the generator's measured turn (generators/liveness.py)",
    )
    interrupt: StrictBool = Field(
        False,
        description="on a new version mid-generation: false finishes the batch on the old "
        "weights, true swaps weights in and continues (per-token versions)",
    )
    redundant_samples: StrictInt = Field(
        0, ge=0, description="r: start n + r samples per group, keep the first n to finish"
    )
    reclaim_idle_s: Number = Field(
        120.0,
        gt=0,
        description="take over prompts another generator claimed this long ago and never "
        "finished (it probably died); a floor: raised to 3x the measured hold, or learner "
        "step + turn (generators/liveness.py)",
    )
    replicate_prompts: StrictBool = Field(
        False,
        description="issue each sample of a group as its own prompt entry, so one group is "
        "spread over generators",
    )
    max_episode_tokens: StrictInt = Field(
        1024,
        gt=0,
        description="multi-turn environments: an episode's response budget (actions + "
        "observations); max_new_tokens limits each turn",
    )
    agent: str | None = Field(
        None,
        description="'pkg.module:run_episode': episodes of this agent program, its model calls "
        "served by the generator's OpenAI-compatible endpoint (docs/agentic.md)",
    )
    agent_timeout_s: Number = Field(
        600.0, gt=0, description="an agent episode running longer is ended: agent_timeout"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="hf engine and reward model: auto takes cuda:0 when torch sees a GPU "
        "(vllm picks its own device)",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vllm engine settings (vllm.LLM arguments)"
    )


class SimConfig(Section):
    """Timing of the simulated engine and learner (`rollout.engine: sim`), for scheduling benchmarks."""

    per_token_s: Number = Field(0.002, gt=0, description="one decode step of a single sequence")
    batch_slowdown: Number = Field(
        0.02, ge=0, description="each extra sequence in a batch slows a decode step by this share"
    )
    length_median: StrictInt = Field(64, gt=0, description="median response length (log-normal)")
    length_sigma: Number = Field(
        1.0, gt=0, description="log-normal sigma: larger means a longer tail"
    )
    learner_step_s: Number = Field(
        0.0, ge=0, description="> 0: the learner sleeps this long per step instead of training"
    )
    vocab_size: StrictInt = Field(64, gt=0, description="token ids the simulated engine draws from")


class TrainerConfig(TrainerGpuKeys):
    actor_lr: Number = Field(1e-4, gt=0, description="AdamW learning rate of the policy")
    weight_decay: Number = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: Number = Field(
        1.0,
        ge=0,
        description="gradient clipping (0 = off); an update whose norm is inf or NaN is "
        "skipped either way (optim/nonfinite_skipped)",
    )
    rollout_batch_size: StrictInt = Field(
        8, gt=0, description="prompts (groups) per learner step: B"
    )
    ppo_mini_batches: StrictInt = Field(
        1,
        gt=0,
        description="M: optimiser updates per pass over the step's groups, each on B / M of "
        "them (PPO mini-batches; verl's ppo_mini_batch_size = B / M)",
    )
    ppo_epochs: StrictInt = Field(
        1, gt=0, description="E: passes over the step's mini-batches (M x E updates per step)"
    )
    micro_batch_size: StrictInt = Field(
        16, gt=0, description="sequences per forward/backward pass (without token_budget)"
    )
    token_budget: StrictInt = Field(
        0,
        ge=0,
        description="> 0: pack sequences, without padding, up to this many tokens per "
        "forward/backward pass instead of micro_batch_size padded rows",
    )
    total_steps: StrictInt = Field(
        20, gt=0, description="learner steps (= weight versions published)"
    )
    async_ratio: Number = Field(
        1.0, ge=0, description="how many versions ahead prompts may be issued (0 = on-policy)"
    )
    overdue_steps: StrictInt = Field(
        4,
        ge=0,
        description="a group still being generated when it reaches ceil(async_ratio) steps of "
        "age is trained when it arrives if at most this many steps older; 0: dropped and "
        "replaced, which costs long responses (docs/asynchrony.md)",
    )
    disable_dropout: StrictBool = Field(
        True,
        description="dropout off in the policy and the critic (LoRA's too), so a PPO ratio "
        "moves with the weights only (TRL's disable_dropout; docs/algorithms.md)",
    )
    keep_versions: StrictInt = Field(
        3, gt=0, description="weight versions kept on disk (plus any a live generator has loaded)"
    )
    num_trainer_workers: StrictInt = Field(
        1, gt=0, description="learner ranks (`rollctl start-learner --nproc` overrides)"
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="with several ranks: full replicas (DDP) or parameters, gradients and "
        "optimiser state sharded (FSDP2)",
    )
    wait_timeout_s: Number = Field(
        600.0, gt=0, description="fail if no trajectory arrives for this long"
    )
    checkpoint_every: StrictInt = Field(
        10,
        ge=0,
        description="checkpoint every N steps and at the end; trajectories are acknowledged "
        "only once their checkpoint is durable (0 = never: acknowledged at publish, and a "
        "crash loses those updates)",
    )
    lr_warmup_steps: StrictInt = Field(
        0, ge=0, description="linear learning-rate warm-up over this many steps"
    )
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="after warm-up")
    publish: Literal["auto", "full", "adapter"] = Field(
        "auto",
        description="weight versions: full, adapter (model.lora only), auto: adapter with lora",
    )

    @model_validator(mode="after")
    def _mini_batches_hold_groups(self) -> TrainerConfig:
        if self.ppo_mini_batches > self.rollout_batch_size:
            raise ConfigError(
                f"trainer.ppo_mini_batches: {self.ppo_mini_batches} mini-batches of "
                f"rollout_batch_size {self.rollout_batch_size} groups would leave some empty; "
                "use at most rollout_batch_size"
            )
        return self

    @property
    def updates_per_step(self) -> int:
        """Optimiser updates of one learner step: ppo_mini_batches x ppo_epochs."""
        return self.ppo_mini_batches * self.ppo_epochs

    @property
    def max_staleness(self) -> int:
        """A group that is ready in time is trained at most this many steps old."""
        return math.ceil(self.async_ratio)

    @property
    def max_overdue_staleness(self) -> int:
        """The oldest a group may be when it arrives: one still being generated when it reached
        max_staleness is trained up to this age, an older one is dropped (docs/asynchrony.md).
        With a = 0 nothing is overdue: training stays on-policy."""
        return self.max_staleness + (self.overdue_steps if self.async_ratio > 0 else 0)


class RewardConfig(Section):
    """The `reward:` section: how generators score a finished response (docs/algorithms.md, RLHF)."""

    # `model_path` is a config key, not pydantic's `model_` API
    model_config = ConfigDict(extra="forbid", validate_assignment=False, protected_namespaces=())

    type: Literal["rule", "model", "mixed"] = Field(
        "rule", description="the task's verifier, a reward model, or both"
    )
    model_path: StrictStr | None = Field(
        None, description="HF dir with a scalar head (`rollctl train-rm`); model / mixed"
    )
    weight_rule: Number = Field(
        1.0, ge=0, description="mixed: reward = weight_rule * rule + weight_model * model score"
    )
    weight_model: Number = Field(
        1.0, ge=0, description="scale of the reward-model score (model and mixed)"
    )
    micro_batch_size: StrictInt = Field(
        64, gt=0, description="responses per reward-model forward pass in the generator"
    )
    max_len: StrictInt = Field(
        512,
        gt=0,
        description="reward-model input tokens (prompt + response + EOS), cut from the left",
    )
    max_abs_reward: Number = Field(
        1e6, gt=0, description="the learner dead-letters a sample whose |reward| is larger"
    )
    functions: list[StrictStr] = Field(
        default_factory=list,
        description="rule reward as reward functions: 'pkg.module:fn', a built-in (math, "
        "exact, regex, json_schema, code, judge) or, from rollflash.Run, a Python callable "
        "(saved as 'python:NAME'); empty = the task's own verifier",
    )
    weights: list[Number] | None = Field(
        None, description="one weight per reward function (null = all 1.0)"
    )
    timeout_s: Number = Field(10.0, gt=0, description="limit of one reward-function call")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="reward-model parameters (auto: model.dtype)"
    )
    code: CodeRewardConfig = Field(default_factory=CodeRewardConfig, description="`code` reward")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="`judge` reward")

    @model_validator(mode="after")
    def _model_path_matches_type(self) -> RewardConfig:
        if self.type != "rule" and not self.model_path:
            raise ConfigError(
                f"reward.model_path: reward.type {self.type!r} needs a reward-model "
                "directory (train one with `rollctl train-rm`)"
            )
        if self.type == "rule" and self.model_path:
            raise ConfigError(
                "reward.model_path: set, but reward.type is 'rule' (use 'model' or 'mixed')"
            )
        return self

    @model_validator(mode="after")
    def _one_weight_per_function(self) -> RewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"reward.weights: {len(self.weights)} weights for "
                f"{len(self.functions)} reward.functions"
            )
        if self.functions and self.type == "model":
            raise ConfigError(
                "reward.functions: set, but reward.type 'model' ignores rule rewards "
                "(use 'rule' or 'mixed')"
            )
        return self


class GuardsConfig(Section):
    """The `guards:` section: reward-hacking warnings (`guard/*` metrics, `rollctl status`)."""

    enabled: StrictBool = Field(True, description="compute the guard/* metrics every step")
    stop_on_guard: StrictBool = Field(
        False, description="end training (summary `stopped_by_guard`) once a guard persists"
    )
    patience: StrictInt = Field(
        3, gt=0, description="consecutive steps a guard must fire before stop_on_guard stops"
    )
    kl_window: StrictInt = Field(
        5, gt=0, description="steps over which the rise of the KL to the reference is measured"
    )
    kl_max_rise: Number = Field(
        0.5,
        ge=0,
        description="warn if KL(behaviour || reference) rose more than this in kl_window "
        "(counted from algo.kl_target when the KL was below it: reaching the target is no rise)",
    )
    score_std_min: Number = Field(
        1e-3, ge=0, description="warn if the batch's reward std falls below this (model rewards)"
    )
    score_std_drop: Number = Field(
        0.05, ge=0, description="... or below this share of the first step's reward std"
    )
    min_length: Number = Field(
        1.5,
        ge=0,
        description="warn if the mean response length (tokens, EOS included) falls below this",
    )
    max_truncated_frac: Number = Field(
        0.5, ge=0, description="warn if more than this share of responses hit max_new_tokens"
    )
    max_mismatch_kl: Number = Field(
        0.05,
        ge=0,
        description="warn if one generator's KL(behaviour || learner) over its tokens of a step "
        "exceeds this (mismatch/kl/<generator>): its engine computes something else",
    )
    ngram_n: StrictInt = Field(3, gt=0, description="n of the repeated n-gram check")
    max_ngram_repeat: Number = Field(
        0.3, ge=0, description="warn if the mean share of repeated n-grams exceeds this"
    )
