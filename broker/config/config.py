"""The run configuration: one YAML file that every process of a run loads.

The config lives in `broker/` because it is part of the contract between processes: the learner
and every generator load the same file, and the learner records its fingerprint in the `run` hash
so that a process started with a config that differs where processes must agree is refused,
naming the keys (broker/config/fingerprint.py, ARCHITECTURE.md).

Names follow ROLL / verl / OpenRLHF habits (`actor_lr`, `rollout_batch_size`,
`num_return_sequences`, `async_ratio`, ...). Loading is strict: an unknown key, a wrong type or an
out-of-range value raises `ConfigError` whose message names the dotted key, e.g.
`trainer.actor_lr: expected a number, got 'fast'`.

The config is a tree of pydantic models: one per section (broker/config/config_sections.py, and
broker/config/config_algo.py for `algo:`), each field with its type, bounds and one-line description.
Rules that tie keys of one section together are validators of that section; those that span
sections are validators of `Config` below. broker/config/config_errors.py words pydantic's first error as
the `ConfigError` message. Loading a config imports neither torch nor `algos`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollflash.broker.config.config_algo import AlgoConfig
from rollflash.broker.config.config_errors import ConfigError, config_error
from rollflash.broker.config.config_eval import EvalConfig, refuse_moved_keys
from rollflash.broker.config.config_gpu import PlacementConfig, VLLMConfig
from rollflash.broker.config.config_logging import LoggingConfig
from rollflash.broker.config.config_model import ModelConfig
from rollflash.broker.config.config_recipes import with_recipe
from rollflash.broker.config.config_rm import RewardModelTrainConfig
from rollflash.broker.config.config_rules import check_rules
from rollflash.broker.config.config_run import RedisConfig, RunConfig
from rollflash.broker.config.config_sections import (
    GuardsConfig,
    RewardConfig,
    RolloutConfig,
    SimConfig,
    TaskConfig,
    TrainerConfig,
)
from rollflash.broker.config.config_weights import WeightsConfig
from rollflash.broker.config.fingerprint import Fingerprint, shared_keys
from rollflash.broker.config.placement import plan_layout
from rollflash.broker.connect.secrets import make_private_dir, without_password, write_private

__all__ = [
    "AlgoConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "GuardsConfig",
    "LoggingConfig",
    "ModelConfig",
    "PlacementConfig",
    "RedisConfig",
    "RewardConfig",
    "RewardModelTrainConfig",
    "RolloutConfig",
    "RunConfig",
    "SimConfig",
    "TaskConfig",
    "TrainerConfig",
    "VLLMConfig",
    "WeightsConfig",
    "apply_override",
    "config_from_dict",
    "load_config",
]


class Config(BaseModel):
    """The whole run config: one section per key of the YAML file."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    run: RunConfig = Field(default_factory=RunConfig, description="run identity and directory")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="the Redis server")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    task: TaskConfig = Field(default_factory=TaskConfig, description="prompts and verifier")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the generators")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the learner")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="the RL algorithm")
    sim: SimConfig = Field(default_factory=SimConfig, description="the simulated engine")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="response scoring")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    rm: RewardModelTrainConfig = Field(
        default_factory=RewardModelTrainConfig, description="`rollctl train-rm`"
    )
    guards: GuardsConfig = Field(
        default_factory=GuardsConfig, description="reward-hacking warnings"
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="metric backends and completions"
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="GPUs of the processes `rollctl run` starts"
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig, description="how weight versions reach the generators"
    )

    @property
    def publish_kind(self) -> str:
        """What a weight version holds: `full` weights or a LoRA `adapter` (`trainer.publish`;
        auto: an adapter when `model.lora` is set, unless vLLM generators would have to load
        `modules_to_save`, which vLLM's LoRA support does not take)."""
        lora = self.model.lora
        if self.trainer.publish != "auto":
            return self.trainer.publish
        if lora is None or (lora.modules_to_save and self.rollout.engine == "vllm"):
            return "full"
        return "adapter"

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML data: sections of str / int / float / bool / None / dict."""
        return self.model_dump()

    def public_dict(self) -> dict[str, Any]:
        """`to_dict` without the Redis password: what is saved, shown or sent to a tracker."""
        data = self.to_dict()
        if data["redis"]["url"]:
            data["redis"]["url"] = without_password(data["redis"]["url"])
        return data

    def fingerprint(self) -> Fingerprint:
        """The keys every process of the run must agree on, with their digest
        (broker/config/fingerprint.py says which keys and why)."""
        return Fingerprint(shared_keys(self.to_dict()))

    def save(self, path: Path) -> None:
        """Write the resolved config with mode 0600 in a directory of mode 0700, without the Redis
        password (broker/connect/secrets.py)."""
        data = self.public_dict()
        make_private_dir(path.parent)
        write_private(path, yaml.safe_dump(data, sort_keys=False))

    @model_validator(mode="before")
    @classmethod
    def _recipe_fills_the_algo_keys(cls, data: Any) -> Any:
        budget = RolloutConfig.model_fields["max_new_tokens"].default
        return with_recipe(data, budget)

    @model_validator(mode="after")
    def _algo_rules_hold(self) -> Config:
        check_rules(self)  # one table: broker/config/config_rules.py
        return self

    @model_validator(mode="after")
    def _dataset_needs_reward_functions(self) -> Config:
        if (
            self.task.name == "dataset"
            and self.reward.type != "model"
            and not self.reward.functions
            and not self.rollout.agent
        ):
            raise ConfigError(
                "reward.functions: task 'dataset' has no verifier of its own; name one or more "
                "reward functions (e.g. [math])"
            )
        return self

    @model_validator(mode="after")
    def _agents_bring_their_rewards(self) -> Config:
        rollout = self.rollout
        if rollout.agent and (self.reward.functions or self.reward.type != "rule"):
            raise ConfigError(
                "rollout.agent: the agent's return is the episode's reward; remove "
                "reward.functions and keep reward.type: rule"
            )
        if rollout.agent and self.trainer.strategy == "fsdp":
            raise ConfigError(
                "trainer.strategy: the learner evaluates agent programs on whole weights; "
                "use ddp with rollout.agent"
            )
        if rollout.agent and rollout.inflight_samples:
            raise ConfigError(
                "rollout.inflight_samples: agent episodes run in pulls; set it to 0 "
                "(rollout.interrupt refills a pull)"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_inside_the_budget(self) -> Config:
        buffer, budget = self.algo.overlong_buffer, self.rollout.max_new_tokens
        if buffer is not None and buffer >= budget:
            raise ConfigError(
                f"algo.overlong_buffer: must be < max_new_tokens ({budget}), got {buffer}"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_without_critic(self) -> Config:
        if self.trainer.strategy == "fsdp" and self.algo.critic:
            raise ConfigError(
                "trainer.strategy: fsdp does not shard the critic yet; use ddp with "
                "algo.critic: true"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits_the_trainer(self) -> Config:
        if self.model.lora is None and self.trainer.publish == "adapter":
            raise ConfigError(
                "trainer.publish: adapter versions need model.lora; set it or publish: full"
            )
        if self.model.lora is not None and self.trainer.strategy == "fsdp":
            raise ConfigError(
                "trainer.strategy: fsdp does not shard LoRA adapters yet; use ddp with model.lora"
            )
        return self

    @model_validator(mode="after")
    def _continuous_batching_needs_vllm_or_sim(self) -> Config:
        if self.rollout.inflight_samples and self.rollout.engine == "hf":
            raise ConfigError(
                "rollout.inflight_samples: continuous batching needs rollout.engine "
                "vllm or sim (transformers' generate runs a batch to its end); set it "
                "to 0 (pulls of rollout.prompts_per_pull)"
            )
        return self

    @model_validator(mode="after")
    def _http_is_served_by_the_publishing_process(self) -> Config:
        if self.weights.transport == "http" and self.trainer.background_publish != "process":
            raise ConfigError(
                "weights.transport: http is served by the learner's publishing process; set "
                "trainer.background_publish: process"
            )
        return self

    @model_validator(mode="after")
    def _gpu_layout_fits(self) -> Config:
        # raises ConfigError; fills in derived worker counts
        plan_layout(self.placement, self.rollout, self.trainer)
        return self

    @model_validator(mode="after")
    def _replicated_prompts_need_one_learner_rank(self) -> Config:
        if self.trainer.num_trainer_workers > 1 and self.rollout.replicate_prompts:
            raise ConfigError(
                "rollout.replicate_prompts: not supported with "
                "trainer.num_trainer_workers > 1 (a group's samples would be read by "
                "different learner ranks)"
            )
        return self


class _Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where a float needs a dot: `1e-4` would be the string '1e-4'.
    YAML 1.2, and the configs people bring, read `1e-4`, `5E-6` and `-1e3` as floats, so they
    are floats here too; anything else keeps YAML 1.1's reading."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_load(text: str) -> Any:
    """Parse config YAML (the files and every `--set` value) with `_Loader`."""
    return yaml.load(text, Loader=_Loader)


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
    node[parts[-1]] = yaml_load(raw)


def config_from_dict(data: dict) -> Config:
    """Validate a parsed YAML mapping; the first problem found raises ConfigError."""
    refuse_moved_keys(data)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise config_error(e, Config) from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists() or path.is_dir():  # a pipe (`--config <(...)`) is read as a file
            raise ConfigError(f"config: file not found: {path}")
        try:
            data = yaml_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML ({e.__class__.__name__})") from e
    for assignment in overrides:
        apply_override(data, assignment)
    return config_from_dict(data)
