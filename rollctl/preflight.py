"""What `rollctl run`, `start-learner` and `start-generator` check before Redis or any process
starts: what can be checked in seconds, each problem once, as one line naming the key and the file
(the project's own errors, rollflash/errors.py). Without these checks each mistake would surface
only once Redis, the learner and the generators had started, in every process that met it.

- `model.path` (a process that loads the model: a learner unless `sim.learner_step_s`, a
  generator unless the sim engine): a model directory, or a hub id in the local cache, holding
  config.json, a tokenizer and its weights, every shard its index names
  (broker/config/model_dir.py `check_model_files`);
- the task: its name and parameters build, with the reward functions, so every import string of
  `reward.functions` is imported (envs/catalog.py `task_from_config`);
- the learner's data: each file of a dataset task (of a mixture's components too), checked on a
  sample of its rows (envs/dataset_check.py); a path that can only be local is never looked up on
  the Hugging Face hub;
- a generator's engine: its package is installed (generators/engine.py `check_engine`);
- the GPUs: a run that asks for GPUs (`placement.gpus`, whose layout the config's validation
  checked, broker/config/placement.py; `trainer.device` or `rollout.device` cuda) finds them on this
  machine.

`rollctl run` checks for its children, which skip the checks (`PREFLIGHT_DONE_ENV`); a child is
started with `python -m` in this directory, so an import string is checked with the directory on
`sys.path`, as the child will import it. How long each check takes: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from rollflash.broker.config.config import Config, ConfigError

PREFLIGHT_DONE_ENV = "ROLLFLASH_PREFLIGHT_DONE"  # set by `rollctl run` for its children
Role = Literal["learner", "generator"]


def preflight(
    cfg: Config, roles: Sequence[Role], children_env: dict[str, str] | None = None
) -> None:
    """Check what a process of each role in `roles` needs (module docstring); raise the first
    problem. `children_env`: the checks are for child processes started with `python -m` with
    this environment added (`rollctl run`), rather than for this process."""
    if os.environ.get(PREFLIGHT_DONE_ENV):
        return
    from rollflash.broker.config.model_dir import check_model_files

    learner, generator = "learner" in roles, "generator" in roles
    loads_model = (learner and cfg.sim.learner_step_s <= 0) or (
        generator and cfg.rollout.engine != "sim"
    )
    if loads_model:
        check_model_files(cfg.model.path)
    if generator:
        from rollflash.generators.engine import check_engine

        check_engine(cfg)
    check_gpus(cfg, learner, generator)
    with _as_children(children_env):
        task = _task(cfg)
    if learner:
        from rollflash.envs.dataset_check import check_dataset

        for where, dataset in dataset_tasks(task):
            check_dataset(dataset, where)


def _task(cfg: Config) -> Any:
    from rollflash.envs import task_from_config

    return task_from_config(cfg)


@contextmanager
def _as_children(env: dict[str, str] | None) -> Iterator[None]:
    """This process's environment and import path as a `python -m` child would have them."""
    if env is None:
        yield
        return
    saved_env, saved_path = dict(os.environ), list(sys.path)
    os.environ.update(env)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


def dataset_tasks(task: Any, where: str = "task.params") -> list[tuple[str, Any]]:
    """The dataset tasks in `task` (itself, one wrapped with reward functions, or a mixture's
    components), each with the key prefix naming its parameters."""
    from rollflash.envs.dataset import DatasetTask
    from rollflash.envs.scored_task import ScoredTask

    if isinstance(task, ScoredTask):
        return dataset_tasks(task.task, where)
    if isinstance(task, DatasetTask):
        return [(where, task)]
    out = []
    for i, c in enumerate(getattr(task, "components", None) or []):
        out += dataset_tasks(c.task, f"task.params.components[{i}].params")
    return out


def check_gpus(cfg: Config, learner: bool, generator: bool) -> None:
    """The GPU ids `placement.gpus` lists are on this machine (the layout itself was checked
    when the config loaded, broker/config/placement.py), and a process that must compute on cuda can
    see a GPU."""
    from rollflash.broker.config.placement import parse_gpus

    asked: list[tuple[str, int]] = []
    if cfg.placement.gpus is not None:
        asked.append(("placement.gpus", 1 + max(int(i) for i in parse_gpus(cfg.placement.gpus))))
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() in ("", "-1")
    hidden = hidden and "CUDA_VISIBLE_DEVICES" in os.environ
    for key, wanted in (("trainer", learner), ("rollout", generator)):
        if wanted and getattr(cfg, key).device == "cuda" and cfg.placement.gpus is None:
            if hidden:
                raise ConfigError(f"{key}.device: cuda, but CUDA_VISIBLE_DEVICES hides every GPU")
            asked.append((f"{key}.device", 1))
    have = gpu_count() if asked else None
    for key, need in asked:
        if have is not None and have < need:
            where = "no NVIDIA GPU" if not have else f"{have} GPU(s)"
            raise ConfigError(f"{key}: needs {need} GPU(s), and this machine has {where}")


def gpu_count() -> int | None:
    """This machine's NVIDIA GPUs (`nvidia-smi -L`, else the driver's /proc entries; 0 without
    either), whatever CUDA_VISIBLE_DEVICES says; None when nvidia-smi fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        gpus = Path("/proc/driver/nvidia/gpus")
        return len(list(gpus.iterdir())) if gpus.is_dir() else 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
