"""The `eval:` section of the run config (learner/evaluation/eval_generate.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt

from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_sections import Number, Section

# keys that moved into `eval:`; a config that still uses one fails at load naming the new key
MOVED = {("trainer", "eval_every"): "eval.every", ("task", "eval_size"): "eval.size"}


def refuse_moved_keys(data: Any) -> None:
    """ConfigError, one line, for a key of MOVED in the raw config mapping `data`."""
    if not isinstance(data, dict):
        return
    for (section, key), new in MOVED.items():
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(
                f"{section}.{key}: moved to {new}; set {new}: {data[section][key]!r} instead"
            )


class EvalConfig(Section):
    """The `eval:` section: held-out evaluation by the learner (learner/evaluation/eval_generate.py)."""

    every: StrictInt = Field(
        0, ge=0, description="evaluate every N learner steps (0 = only before and after training)"
    )
    size: StrictInt = Field(
        200, ge=0, description="held-out items (or episodes) evaluated (0 = all)"
    )
    n_samples: StrictInt = Field(
        0,
        ge=0,
        description="k > 0: also sample k responses per held-out item and report mean reward, "
        "pass@1 and pass@k (0 = greedy accuracy only; single-turn tasks, not with strategy fsdp)",
    )
    temperature: Number = Field(1.0, gt=0, description="sampling temperature of those samples")
    max_new_tokens: StrictInt | None = Field(
        None, gt=0, description="response length limit in evaluation (null = rollout's)"
    )
    threshold: Number = Field(
        1.0, description="a response is correct when its reward is at least this"
    )
    keep_best: StrictBool = Field(
        True,
        description="keep the version with the best held-out accuracy under run_dir/best "
        "(`rollctl export --best`), whatever the retention of weights/ deletes",
    )
