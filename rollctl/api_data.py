"""What `rollflash.Run` turns into a config before anything starts (rollctl/api.py): the config
and its sections, reward functions given as Python callables, and in-memory datasets.

A dataset given to Run (a list of dicts, a `datasets.Dataset`, any iterable of mappings) is
written to the run directory as JSONL, `{run_dir}/data/train.jsonl` (and `eval.jsonl` for
`eval_dataset`), and the run's task becomes `task.name: dataset` reading those files: the
learner and every generator, on this host or another one that shares the run directory, read
the same rows. A run's rows are fixed once it has trained (metrics.jsonl exists): a second
start of it with other rows is refused in one line, as a changed config is.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from rollflash.broker.config.config import Config, ConfigError
from rollflash.envs.remote_rewards import PREFIX

DATA_FILES = {"dataset": "train.jsonl", "eval_dataset": "eval.jsonl"}  # under {run_dir}/data/


def config_data(config: str | Path | Mapping[str, Any] | Config | None) -> dict[str, Any]:
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


def merged(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with the keys of `values` replaced, nested mappings key by key."""
    out = dict(base)
    for key, value in values.items():
        old = out.get(key)
        both = isinstance(old, Mapping) and isinstance(value, Mapping)
        out[key] = merged(old, value) if both else value  # type: ignore[arg-type]
    return out


def take_callables(data: dict[str, Any]) -> dict[str, Callable[..., Any]]:
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


def use_datasets(data: dict[str, Any], run_dir: Path, given: dict[str, Any]) -> None:
    """Make the run's task read the datasets `given` (keyword -> rows) from the run directory
    (module docstring); the `task` section keeps its dataset params (prompt_key, ...). A
    config's own other task has been dropped (rollctl/api.py): another one named here is an
    error."""
    task = data.get("task") or {}
    if not isinstance(task, Mapping):
        raise ConfigError(f"task: expected a mapping of the section's keys, got {task!r}")
    if task.get("name", "dataset") != "dataset":
        raise ConfigError(
            f"task.name: {task['name']!r} and dataset= name two tasks; rows are read by the "
            "dataset task"
        )
    params = dict(task.get("params") or {})
    for keyword, key in (("dataset", "path"), ("eval_dataset", "eval_path")):
        if keyword in given and key in params:
            raise ConfigError(
                f"task.params.{key}: {params[key]!r} and {keyword}= name two datasets; give one"
            )
        if keyword in given:
            params[key] = str(run_dir / "data" / DATA_FILES[keyword])
    if "dataset" not in given and "path" not in params:
        raise ConfigError(
            "eval_dataset: needs the training rows too (dataset=, or task.params.path)"
        )
    data["task"] = {"name": "dataset", "params": params}


def write_rows(rows: Iterable[Any], path: Path, what: str) -> None:
    """Write `rows` (mappings of columns) to `path` as JSONL, unless the file holds them already;
    ConfigError (one line) for a row that is not a mapping of JSON values, no rows at all, or a
    run that trained on other rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    digest, count = hashlib.sha256(), 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                if not isinstance(row, Mapping):
                    raise ConfigError(
                        f"{what}[{i}]: expected a mapping of columns, got {row!r:.80}"
                    )
                try:
                    line = json.dumps(dict(row), ensure_ascii=False) + "\n"
                except (TypeError, ValueError) as e:
                    raise ConfigError(f"{what}[{i}]: not JSON data ({e})") from None
                f.write(line)
                digest.update(line.encode())
                count += 1
        if not count:
            raise ConfigError(f"{what}: no rows")
        if path.is_file() and _sha256(path) == digest.hexdigest():
            return
        if path.is_file() and (path.parent.parent / "metrics.jsonl").is_file():
            raise ConfigError(
                f"{what}: {path} holds other rows, which this run has trained on; a run's rows "
                "are fixed: choose another run.run_dir"
            )
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
