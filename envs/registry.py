"""Task registry: config name -> task class.

Configs name a task (or a multi-turn environment) and pass its constructor parameters as a dict;
a typo in either is an error that names the culprit, never a silent default. Add a task by adding
one entry to `_REGISTRY`. `task_from_config` adds the run's reward functions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rollflash.envs.arithmetic import ArithmeticTask
from rollflash.envs.base import Task
from rollflash.envs.dataset import DatasetTask
from rollflash.envs.gridworld import gridworld_task
from rollflash.envs.multiturn import is_multi_turn
from rollflash.envs.reward_functions import RewardFunctions, ScoredTask
from rollflash.envs.simulated import simulated_task
from rollflash.envs.sokoban import sokoban_task
from rollflash.envs.tools import tool_use_task

_REGISTRY: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "dataset": DatasetTask,  # the user's rows (envs/dataset.py); scored by reward.functions
    # multi-turn environments (envs/multiturn.py): an EnvTask whose items are episode seeds
    "gridworld": gridworld_task,
    "sokoban": sokoban_task,
    "tool_use": tool_use_task,
    "sim_env": simulated_task,
}


def known_tasks() -> list[str]:
    """Names `make_task` accepts, sorted."""
    return sorted(_REGISTRY)


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build the task `name` with constructor keyword arguments `params`.

    Raises ValueError naming the known tasks for an unknown name, and naming the key (and the accepted
    keys) for an unknown parameter, before the constructor runs.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    factory = _REGISTRY[name]
    params = dict(params or {})
    accepted = [p for p in inspect.signature(factory).parameters if p != "self"]
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"unknown parameter {key!r} for task {name!r}; accepted: {', '.join(accepted)}"
            )
    return factory(**params)


def task_from_config(cfg: Any) -> Task:
    """The task of a run config (`task:`), scored by `reward.functions` when it names any; the
    learner and every generator build it this way. Reward-function import errors raise here."""
    task = make_task(cfg.task.name, cfg.task.params)
    r = cfg.reward
    if not r.functions:
        return task
    if is_multi_turn(task):
        raise ValueError(
            f"reward.functions: score single responses; multi-turn task {cfg.task.name!r} is "
            "scored by its environment"
        )
    return ScoredTask(task, RewardFunctions.load(r.functions, r.weights, r.timeout_s))
