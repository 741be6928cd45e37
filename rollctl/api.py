"""The Python API: `Run(config, **sections).train()` runs what `rollctl run` runs.

    from rollflash import Run

    result = Run(
        "configs/demo.yaml",
        trainer={"total_steps": 20},
        reward={"functions": [lambda prompt, response, answer, **row: float(response == answer)]},
    ).train()
    result.summary["heldout_acc_after"], result.run_dir

`config` is a YAML file, a mapping of its sections, or a `Config`; each keyword is a section whose
keys replace those of the config (`trainer={"total_steps": 20}`; a nested mapping such as
`rollout={"vllm": {...}}` replaces key by key too). The config is validated at once, with the
one-line `ConfigError` of any bad key. `train()` runs `rollctl run`'s processes
(rollctl/local.py: the embedded Redis, the learner, the generators, the same layout and logs) and
returns the summary with the run directory, or raises `RunFailed` naming the learner's log;
interrupting it (Ctrl-C, a notebook's stop button) stops the processes and raises
KeyboardInterrupt. A second `train()` of the same run directory resumes it, as `rollctl run` does.

Reward functions (`reward.functions`) may be Python callables beside the built-in names and
import strings; a callable stays in this process, which serves it to the learner and generators
for as long as `train()` runs (envs/remote_rewards.py says how and what it costs). With callables
the learner runs one rank (`trainer.num_trainer_workers: 1`): torchrun's ranks are started
afresh and cannot reach this process's functions.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollflash.broker.config import Config, ConfigError, config_from_dict
from rollflash.envs.remote_rewards import PREFIX, serve_functions
from rollflash.errors import RollflashError


@dataclass(frozen=True)
class RunResult:
    summary: dict[str, Any]  # summary.json: heldout_acc_before/after, reward_first10, ...
    run_dir: Path


class RunFailed(RollflashError):
    """The learner did not finish; the message names its exit code and its log."""


class Run:
    """One run, ready to `train()`; see the module docstring."""

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | Config | None = None,
        *,
        echo: bool = True,
        **sections: Mapping[str, Any],
    ):
        data = _config_data(config)
        for name, values in sections.items():
            if not isinstance(values, Mapping):
                raise ConfigError(
                    f"{name}: expected a mapping of the section's keys, got {values!r}"
                )
            data[name] = _merged(data.get(name) or {}, values)
        self.functions = _take_callables(data)
        self.config = config_from_dict(data)
        if self.functions and self.config.trainer.num_trainer_workers > 1:
            raise ConfigError(
                "trainer.num_trainer_workers: reward functions given as Python callables need "
                "one learner rank (torchrun's ranks cannot reach them); name them by import "
                "strings ('package.module:function') for more"
            )
        self.echo = echo

    def train(self) -> RunResult:
        """Run the learner and generators to the end of training (module docstring)."""
        from rollflash.rollctl.local import EXIT_INTERRUPTED, run_local

        cfg = self.config.model_copy(deep=True)  # run_local fills in the Redis URL and layout
        with serve_functions(self.functions) as env:
            code = run_local(cfg, echo=self.echo, extra_env=env)
        run_dir = Path(cfg.run.run_dir)
        if code == EXIT_INTERRUPTED:
            raise KeyboardInterrupt
        if code != 0:
            raise RunFailed(f"the learner exited with {code}; see {run_dir / 'logs/learner.log'}")
        return RunResult(json.loads((run_dir / "summary.json").read_text()), run_dir)


def _config_data(config: str | Path | Mapping[str, Any] | Config | None) -> dict[str, Any]:
    """The config as YAML data, with only the keys it sets (the others keep their defaults, and
    `rollctl run` still chooses what a config leaves open, e.g. the number of generators)."""
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.model_dump(exclude_unset=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    return yaml.safe_load(path.read_text()) or {}


def _merged(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in values.items():
        old = out.get(key)
        both = isinstance(old, Mapping) and isinstance(value, Mapping)
        out[key] = _merged(old, value) if both else value  # type: ignore[arg-type]
    return out


def _take_callables(data: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """Replace each callable of `reward.functions` by its spec `python:NAME`; returns them."""
    reward = data.get("reward")
    if not isinstance(reward, dict) or not isinstance(reward.get("functions"), list):
        return {}
    functions: dict[str, Callable[..., Any]] = {}
    specs = []
    for fn in reward["functions"]:
        if not callable(fn):
            specs.append(fn)
            continue
        name = getattr(fn, "__name__", "")
        base = f"{PREFIX}{name if name.isidentifier() else 'lambda'}"
        spec, k = base, 1
        while spec in functions:
            k += 1
            spec = f"{base}_{k}"
        functions[spec] = fn
        specs.append(spec)
    reward["functions"] = specs
    return functions
