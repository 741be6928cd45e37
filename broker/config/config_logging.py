"""The `logging:` section of the run config: where the learner's metrics and sample completions go.

Only the learner reads it, so it is left out of the run's fingerprint (broker/config/config.py): a
generator started with another tracker setting still joins the run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, StrictStr, field_validator

from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_sections import Section

Backend = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


def _default_backends() -> list[Backend]:
    return ["jsonl", "tensorboard"]


class LoggingConfig(Section):
    """The `logging:` section: metric backends (trackers) and sample completions."""

    backends: list[Backend] = Field(
        default_factory=_default_backends,
        description="where step metrics go; jsonl is always on (wandb, mlflow: optional extras)",
    )
    project: StrictStr = Field(
        "rollflash", description="the W&B project and the MLflow experiment name"
    )
    run_name: StrictStr | None = Field(
        None, description="the tracker's run name (null = run.run_id)"
    )
    tags: list[StrictStr] = Field(
        default_factory=list, description="tags given to the tracker run (W&B tags, MLflow tags)"
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B: online syncs to the server, offline writes under run_dir/wandb"
    )
    wandb_entity: StrictStr | None = Field(
        None, description="W&B team or user (null = the logged-in default)"
    )
    mlflow_tracking_uri: StrictStr | None = Field(
        None,
        description="MLflow server or file store, e.g. file:runs/mlruns (null = $MLFLOW_TRACKING_URI "
        "or MLflow's default ./mlruns)",
    )
    completions_per_step: StrictInt = Field(
        0,
        ge=0,
        description="samples per step logged with prompt, response and reward: best, worst, then "
        "random (0 = none)",
    )

    @field_validator("backends")
    @classmethod
    def _jsonl_once(cls, backends: list[str]) -> list[str]:
        if "jsonl" not in backends:
            raise ConfigError(
                "logging.backends: must include jsonl (metrics.jsonl feeds summary.json and "
                f"`rollctl plot`), got {backends}"
            )
        if len(set(backends)) != len(backends):
            raise ConfigError(f"logging.backends: a backend is listed twice, got {backends}")
        return backends
