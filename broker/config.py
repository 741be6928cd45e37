"""The run configuration: one YAML file that every process of a run loads.

The config lives in `broker/` because it is part of the contract between processes: the learner
and every generator load the same file, and the learner records its fingerprint in the `run` hash
so that a process started with a different file is refused (see ARCHITECTURE.md).

Names follow ROLL / verl / OpenRLHF habits (`actor_lr`, `rollout_batch_size`,
`num_return_sequences`, `async_ratio`, ...). Loading is strict: an unknown key, a wrong type or an
out-of-range value raises `ConfigError` whose message names the dotted key, e.g.
`trainer.actor_lr: expected a number, got 'fast'`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem; the message starts with the dotted key at fault."""


@dataclass
class RunConfig:
    run_id: str = "demo"  # names the Redis keys rl:{run_id}:* and the run directory
    run_dir: str = "runs/demo"  # checkpoints, weights, metrics, summary.json
    seed: int = 0  # seeds prompt order, sampling and initialisation
    torch_threads: int = 0  # intra-op threads per process (0 = torch's default)


@dataclass
class RedisConfig:
    url: str | None = None  # redis://, rediss:// or unix://; None lets `rollctl run` start its own
    connect_timeout_s: float = 30.0  # give up connecting (with backoff) after this long
    max_payload_bytes: int = (
        8_000_000  # entries larger than this go to the dead-letter stream undecoded
    )


@dataclass
class ModelConfig:
    path: str = "models/tiny"  # local Hugging Face model directory (config, tokenizer, weights)
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype in learner and generators


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # a task from envs.registry
    params: dict = field(default_factory=dict)  # passed to the task's constructor
    eval_size: int = 200  # held-out items used for greedy evaluation (0 = all)


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm", "sim"] = "hf"  # inference engine of the generators
    num_return_sequences: int = 8  # samples per prompt: the GRPO group size
    max_new_tokens: int = 8  # response length limit
    temperature: float = 1.0  # sampling temperature (the learner scales logits by it too)
    top_p: float = 1.0  # nucleus sampling threshold
    prompts_per_pull: int = 4  # prompts a generator claims and samples as one batch
    inflight_samples: int = 0  # > 0: continuous batching instead of pulls: up to this many
    #                            samples decoding, new prompts claimed as their slots free up
    num_rollout_workers: int = 2  # generator processes started by `rollctl run`
    heartbeat_ttl_s: float = 30.0  # a generator's status hash expires this long after its last beat
    interrupt: bool = False  # on a new version mid-generation: False finishes the batch on the old
    #                          weights, True swaps weights in and continues (per-token versions)
    redundant_samples: int = 0  # r: start n + r samples per group, keep the first n to finish
    reclaim_idle_s: float = 120.0  # take over prompts another generator claimed this long ago
    #                                and never finished (it probably died)
    replicate_prompts: bool = False  # issue each sample of a group as its own prompt entry, so
    #                                  one group is spread over generators
    max_episode_tokens: int = 1024  # multi-turn environments: an episode's response budget
    #                                 (actions + observations); max_new_tokens limits each turn


@dataclass
class SimConfig:
    """Timing of the simulated engine and learner (`rollout.engine: sim`), for scheduling benchmarks."""

    per_token_s: float = 0.002  # one decode step of a single sequence
    batch_slowdown: float = 0.02  # each extra sequence in a batch slows a decode step by this share
    length_median: int = 64  # median response length (log-normal)
    length_sigma: float = 1.0  # log-normal sigma: larger means a longer tail
    learner_step_s: float = 0.0  # > 0: the learner sleeps this long per step instead of training
    vocab_size: int = 64  # token ids the simulated engine draws from


@dataclass
class TrainerConfig:
    actor_lr: float = 1e-4  # AdamW learning rate of the policy
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    rollout_batch_size: int = 8  # prompts (groups) per learner step: B
    micro_batch_size: int = 16  # sequences per forward/backward pass (without token_budget)
    token_budget: int = 0  # > 0: pack sequences, without padding, up to this many tokens per
    #                        forward/backward pass instead of micro_batch_size padded rows
    total_steps: int = 20  # learner steps (= weight versions published)
    async_ratio: float = 1.0  # how many versions ahead prompts may be issued (0 = on-policy)
    eval_every: int = 0  # greedy held-out evaluation every N steps (0 = only before and after)
    keep_versions: int = 3  # weight versions kept on disk (plus any a live generator has loaded)
    num_trainer_workers: int = 1  # learner ranks (`rollctl start-learner --nproc` overrides)
    strategy: Literal["ddp", "fsdp"] = "ddp"  # with several ranks: full replicas (DDP) or
    #                                           parameters, gradients and optimiser state sharded (FSDP2)
    wait_timeout_s: float = 600.0  # fail if no trajectory arrives for this long
    checkpoint_every: int = 10  # checkpoint every N steps and at the end; trajectories are
    #                             acknowledged only once their checkpoint is durable (0 = never:
    #                             acknowledged at publish, and a crash loses those updates)
    lr_warmup_steps: int = 0  # linear learning-rate warm-up over this many steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warm-up

    @property
    def max_staleness(self) -> int:
        """Samples older than `version - max_staleness` are dropped (ARCHITECTURE.md)."""
        return math.ceil(self.async_ratio)


@dataclass
class AlgoConfig:
    """The `algo:` section; docs/algorithms.md gives each key's formula and paper. The names of the
    enumerations are the keys of the algos registries, written out so that loading a config does not
    import torch (tests/unit/test_learner_config.py checks that they match)."""

    adv_estimator: Literal[
        "grpo", "dr_grpo", "rloo", "gae", "reinforce++", "reinforce++-baseline", "gigpo"
    ] = "grpo"  # advantage estimator (algos.ADVANTAGE_ESTIMATORS); gae needs critic: true;
    #             gigpo (step-level, multi-turn environments only) discounts turns by gamma
    policy_loss: Literal["ppo", "gspo", "cispo", "topr", "reinforce"] = "ppo"  # algos.POLICY_LOSSES
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound 1 + clip_high (DAPO: 0.28)
    dual_clip_c: float | None = 3.0  # dual-clip bound for negative advantages (None = off)
    tis_cap: float | None = 2.0  # cap of the importance weight pi_prox / pi_behaviour (None = off)
    is_mode: Literal["truncate", "mask"] = (
        "truncate"  # cap the IS weight, or drop tokens outside bounds
    )
    is_level: Literal["token", "sequence", "geometric"] = (
        "token"  # what the IS weight is a ratio of
    )
    is_low: float | None = (
        None  # lower edge of the kept IS interval with is_mode: mask (IcePop: 0.5)
    )
    kl_coef: float = 0.0  # weight of the KL to the frozen initial policy (0 = no reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token KL estimator (algos.KL_ESTIMATORS)
    use_kl_in_reward: bool = (
        False  # subtract kl_coef * KL from token rewards instead of a loss term
    )
    entropy_coef: float = 0.0  # weight of the entropy bonus (0 = entropy not computed)
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"  # how token losses are averaged (algos.AGG_MODES)
    norm_len: float | None = (
        None  # divisor of seq-mean-token-sum-norm (None = rollout.max_new_tokens)
    )
    whiten_advantages: bool = False  # z-score advantages over the batch's response tokens (as ROLL)
    gamma: float = 1.0  # per-token discount (gae, reinforce++)
    lam: float = 0.95  # GAE lambda
    critic: bool = False  # train a value model (policy backbone + scalar head); needed by gae only
    critic_lr: float = 1e-4  # AdamW learning rate of the critic
    clip_range_value: float | None = None  # value clipping around the old values (None = unclipped)
    reward_clip: float | None = None  # clamp scores to [-reward_clip, reward_clip] (None = off)
    reward_norm: Literal["none", "batch", "group", "running"] = "none"  # z-scoring of the scores
    dynamic_sampling: bool = False  # drop groups whose scores are all equal (DAPO)
    overlong_filter: bool = False  # mask truncated samples out of the loss (DAPO)
    overlong_buffer: int | None = (
        None  # soft overlong penalty over the budget's last N tokens (None = off)
    )
    overlong_penalty_factor: float = 1.0  # scale of the soft overlong penalty
    kl_target: float | None = None  # adaptive kl_coef aiming at this per-token KL (None = fixed)
    kl_horizon: float = 10000.0  # samples over which the adaptive kl_coef moves by up to 20%


@dataclass
class RewardConfig:
    """The `reward:` section: how generators score a finished response (docs/algorithms.md, RLHF)."""

    type: Literal["rule", "model", "mixed"] = "rule"  # the task's verifier, a reward model, or both
    model_path: str | None = None  # HF dir with a scalar head (`rollctl train-rm`); model / mixed
    weight_rule: float = 1.0  # mixed: reward = weight_rule * rule + weight_model * model score
    weight_model: float = 1.0  # scale of the reward-model score (model and mixed)
    micro_batch_size: int = 64  # responses per reward-model forward pass in the generator
    max_len: int = 512  # reward-model input tokens (prompt + response + EOS), cut from the left
    max_abs_reward: float = 1e6  # the learner dead-letters a sample whose |reward| is larger


@dataclass
class RewardModelTrainConfig:
    """The `rm:` section, read by `rollctl train-rm` only: Bradley-Terry reward-model training
    (names as OpenRLHF's train_rm)."""

    pretrain: str | None = None  # initial weights, a local HF dir (None = model.path)
    dataset: str = "data/preferences.jsonl"  # JSONL of {"prompt", "chosen", "rejected"}
    eval_dataset: str | None = None  # held-out pairs (None = the last eval_split of dataset)
    eval_split: float = 0.1  # share of dataset held out when eval_dataset is None
    save_path: str = "models/rm"  # where the trained model is saved (a standard HF directory)
    max_epochs: int = 1  # passes over the training pairs
    max_steps: int = 0  # stop after this many optimiser steps (0 = max_epochs decides)
    learning_rate: float = 1e-4  # AdamW peak lr (linear warm-up, cosine decay to 10%)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    train_batch_size: int = 32  # preference pairs per optimiser step, over all ranks
    micro_train_batch_size: int = 32  # pairs per forward/backward on one rank
    max_len: int = 512  # tokens of prompt + response + EOS, cut from the left
    eval_every: int = 0  # held-out accuracy every N steps (0 = only before and after)


@dataclass
class GuardsConfig:
    """The `guards:` section: reward-hacking warnings (`guard/*` metrics, `rollctl status`)."""

    enabled: bool = True  # compute the guard/* metrics every step
    stop_on_guard: bool = False  # end training (summary `stopped_by_guard`) once a guard persists
    patience: int = 3  # consecutive steps a guard must fire before stop_on_guard stops
    kl_window: int = 5  # steps over which the rise of the KL to the reference is measured
    kl_max_rise: float = 0.5  # warn if KL(behaviour || reference) rose more than this in kl_window
    score_std_min: float = 1e-3  # warn if the batch's reward std falls below this (model rewards)
    score_std_drop: float = 0.05  # ... or below this share of the first step's reward std
    min_length: float = 1.5  # warn if the mean response length (tokens, EOS included) falls below
    max_truncated_frac: float = 0.5  # warn if more than this share of responses hit max_new_tokens
    ngram_n: int = 3  # n of the repeated n-gram check
    max_ngram_repeat: float = 0.3  # warn if the mean share of repeated n-grams exceeds this


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rm: RewardModelTrainConfig = field(default_factory=RewardModelTrainConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)

    @property
    def key_prefix(self) -> str:
        return f"rl:{self.run.run_id}:"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """sha256 of the fields every process must agree on (not run-local paths or counts)."""
        shared = {k: v for k, v in self.to_dict().items() if k not in ("redis",)}
        shared["rollout"] = {
            k: v for k, v in shared["rollout"].items() if k != "num_rollout_workers"
        }
        shared["trainer"] = {
            k: v for k, v in shared["trainer"].items() if k != "num_trainer_workers"
        }
        blob = json.dumps(shared, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


_POSITIVE = {
    "rollout.num_return_sequences",
    "rollout.max_new_tokens",
    "rollout.prompts_per_pull",
    "trainer.rollout_batch_size",
    "trainer.micro_batch_size",
    "trainer.total_steps",
    "trainer.actor_lr",
    "trainer.keep_versions",
    "trainer.num_trainer_workers",
    "trainer.wait_timeout_s",
    "redis.connect_timeout_s",
    "redis.max_payload_bytes",
    "rollout.temperature",
    "rollout.heartbeat_ttl_s",
    "rollout.max_episode_tokens",
    "rollout.reclaim_idle_s",
    "sim.per_token_s",
    "sim.length_median",
    "sim.length_sigma",
    "sim.vocab_size",
}
_NON_NEGATIVE = {
    "run.torch_threads",
    "trainer.token_budget",
    "trainer.checkpoint_every",
    "trainer.lr_warmup_steps",
    "trainer.async_ratio",
    "trainer.eval_every",
    "trainer.max_grad_norm",
    "trainer.weight_decay",
    "rollout.num_rollout_workers",
    "task.eval_size",
    "rollout.redundant_samples",
    "rollout.inflight_samples",
    "sim.batch_slowdown",
    "sim.learner_step_s",
}


def _check_ranges(cfg: Config) -> None:
    flat = _flatten(cfg.to_dict())
    for key in _POSITIVE:
        if not flat[key] > 0:
            raise ConfigError(f"{key}: must be > 0, got {flat[key]!r}")
    for key in _NON_NEGATIVE:
        if not flat[key] >= 0:
            raise ConfigError(f"{key}: must be >= 0, got {flat[key]!r}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {cfg.rollout.top_p!r}")
    if not 0 < cfg.algo.clip_low < 1:
        raise ConfigError(f"algo.clip_low: must be in (0, 1), got {cfg.algo.clip_low!r}")
    if not cfg.algo.clip_high > 0:
        raise ConfigError(f"algo.clip_high: must be > 0, got {cfg.algo.clip_high!r}")
    if cfg.algo.tis_cap is not None and cfg.algo.tis_cap < 1:
        raise ConfigError(f"algo.tis_cap: must be >= 1 or null, got {cfg.algo.tis_cap!r}")
    if cfg.trainer.strategy == "fsdp" and cfg.algo.critic:
        raise ConfigError(
            "trainer.strategy: fsdp does not shard the critic yet; use ddp with algo.critic: true"
        )
    if cfg.rollout.inflight_samples and cfg.rollout.engine == "hf":
        raise ConfigError(
            "rollout.inflight_samples: continuous batching needs rollout.engine "
            "vllm or sim (transformers' generate runs a batch to its end); set it "
            "to 0 (pulls of rollout.prompts_per_pull)"
        )
    if cfg.trainer.num_trainer_workers > 1 and cfg.rollout.replicate_prompts:
        raise ConfigError(
            "rollout.replicate_prompts: not supported with "
            "trainer.num_trainer_workers > 1 (a group's samples would be read by "
            "different learner ranks)"
        )
    _check_algo(cfg)
    _check_rlhf(cfg)


def _check_rlhf(cfg: Config) -> None:
    """The reward, rm and guards sections, and algo.kl_target / kl_horizon (issue 9)."""
    flat = _flatten(cfg.to_dict())
    for key in (
        "reward.micro_batch_size",
        "reward.max_abs_reward",
        "reward.max_len",
        "rm.learning_rate",
        "rm.train_batch_size",
        "rm.micro_train_batch_size",
        "rm.max_len",
        "rm.max_epochs",
        "algo.kl_horizon",
        "guards.patience",
        "guards.kl_window",
        "guards.ngram_n",
    ):
        if not flat[key] > 0:
            raise ConfigError(f"{key}: must be > 0, got {flat[key]!r}")
    for key in (
        "reward.weight_rule",
        "reward.weight_model",
        "rm.max_steps",
        "rm.eval_every",
        "rm.weight_decay",
        "rm.max_grad_norm",
        "guards.kl_max_rise",
        "guards.score_std_min",
        "guards.score_std_drop",
        "guards.min_length",
        "guards.max_truncated_frac",
        "guards.max_ngram_repeat",
    ):
        if not flat[key] >= 0:
            raise ConfigError(f"{key}: must be >= 0, got {flat[key]!r}")
    if cfg.reward.type != "rule" and not cfg.reward.model_path:
        raise ConfigError(
            f"reward.model_path: reward.type {cfg.reward.type!r} needs a reward-model "
            "directory (train one with `rollctl train-rm`)"
        )
    if cfg.reward.type == "rule" and cfg.reward.model_path:
        raise ConfigError(
            "reward.model_path: set, but reward.type is 'rule' (use 'model' or 'mixed')"
        )
    if not 0 < cfg.rm.eval_split < 1:
        raise ConfigError(f"rm.eval_split: must be in (0, 1), got {cfg.rm.eval_split!r}")
    if cfg.rm.train_batch_size % cfg.rm.micro_train_batch_size:
        raise ConfigError(
            f"rm.train_batch_size: must be a multiple of rm.micro_train_batch_size "
            f"({cfg.rm.micro_train_batch_size}), got {cfg.rm.train_batch_size}"
        )
    if cfg.algo.kl_target is not None:
        if not cfg.algo.kl_target > 0:
            raise ConfigError(f"algo.kl_target: must be > 0 or null, got {cfg.algo.kl_target!r}")
        if not cfg.algo.kl_coef > 0:
            raise ConfigError(
                "algo.kl_target: the adaptive controller needs a starting "
                "algo.kl_coef > 0 (InstructGPT: 0.02)"
            )


_GROUP_BASELINES = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce++-baseline",
    "gigpo",
)  # baseline from the group


def _check_algo(cfg: Config) -> None:
    """Run algos.validate_algo_choice on the `algo:` section and re-raise its ValueError as a
    ConfigError that starts with `algo.<key>:`. algos is imported here, not at the top, so that
    `import broker.config` (and `rollctl --help`) stays torch-free."""
    from rollflash.algos import validate_algo_choice

    a, n = cfg.algo, cfg.rollout.num_return_sequences
    if n < 2 and (a.adv_estimator in _GROUP_BASELINES or a.dynamic_sampling):
        raise ConfigError(
            f"rollout.num_return_sequences: algo.adv_estimator {a.adv_estimator!r} and "
            f"algo.dynamic_sampling need groups of at least 2 samples, got {n}"
        )
    for key in ("critic_lr", "norm_len"):
        value = getattr(a, key)
        if value is not None and not value > 0:
            raise ConfigError(f"algo.{key}: must be > 0, got {value!r}")
    try:
        validate_algo_choice(
            a.adv_estimator,
            a.policy_loss,
            a.critic,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip_c=a.dual_clip_c,
            tis_cap=a.tis_cap,
            is_mode=a.is_mode,
            is_level=a.is_level,
            is_low=a.is_low,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            loss_agg_mode=a.loss_agg_mode,
            norm_len=a.norm_len or float(cfg.rollout.max_new_tokens),
            gamma=a.gamma,
            lam=a.lam,
            clip_range_value=a.clip_range_value,
            reward_clip=a.reward_clip,
            reward_norm=a.reward_norm,
            dynamic_sampling=a.dynamic_sampling,
            overlong_buffer=a.overlong_buffer,
            overlong_penalty_factor=a.overlong_penalty_factor,
            max_new_tokens=cfg.rollout.max_new_tokens,
            num_return_sequences=n,
        )
    except ValueError as e:
        # validate_algo_choice writes "algo.gamma must be ..." or "algo.adv_estimator: ..."
        raise ConfigError(re.sub(r"^(algo\.\w+) ", r"\1: ", str(e))) from None


def _flatten(d: dict) -> dict[str, Any]:
    """{"section.key": value} for the one level of sections (task.params stays a dict)."""
    return {f"{section}.{k}": v for section, fields in d.items() for k, v in fields.items()}


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a type hint; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {list(allowed)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    raise TypeError(f"unsupported config type {hint!r} for {key}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(known))})")
    kwargs = {}
    for name in known & set(data):
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, data[name], f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(data[name], hint, f"{prefix}{name}")
    return cls(**kwargs)


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `section.key=value` override in place; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def config_from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    _check_ranges(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML ({e.__class__.__name__})") from e
    for assignment in overrides:
        apply_override(data, assignment)
    return config_from_dict(data)
