"""Task catalog: config name -> task class, or environment class for a multi-turn task.

Configs name a task (or a multi-turn environment) and pass its constructor parameters as a dict;
a typo in either is an error that names the culprit, never a silent default. Add a task by adding
one entry to `_TASKS`, or a multi-turn environment with one entry to `_ENVIRONMENTS`: its task's
parameters are the environment class's own plus `heldout_size`. `task_from_config` adds the run's
reward functions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from rollflash.envs.arithmetic import ArithmeticTask
from rollflash.envs.base import Task
from rollflash.envs.dataset import DatasetTask
from rollflash.envs.gridworld import GridWorld
from rollflash.envs.mixture import MixtureTask
from rollflash.envs.multiturn import Env, EnvTask, is_multi_turn
from rollflash.envs.oneliner import OneLinerTask
from rollflash.envs.reasoning_gym import reasoning_gym_task
from rollflash.envs.reward_functions import RewardFunctions
from rollflash.envs.scored_task import ScoredTask
from rollflash.envs.simulated import SimulatedEnv
from rollflash.envs.sokoban import Sokoban
from rollflash.envs.tools import ToolUse
from rollflash.errors import BadInput


def mixture_task(components: list[dict[str, Any]]) -> MixtureTask:
    """`task: mixture` (envs/mixture.py): each component's task is built by this catalog."""
    return MixtureTask.from_specs(components, make_task)


_TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "dataset": DatasetTask,  # the user's rows (envs/dataset.py); scored by reward.functions
    "mixture": mixture_task,  # several tasks at weights, each with its own rewards (envs/mixture.py)
    "oneliner": OneLinerTask,  # generated code: print a*x + b, checked in the sandbox
    "reasoning_gym": reasoning_gym_task,  # the reasoning-gym package's datasets, as a mixture
}

# multi-turn environments (envs/multiturn.py): an EnvTask whose items are episode seeds;
# name -> (environment class, default number of held-out episodes)
_ENVIRONMENTS: dict[str, tuple[Callable[..., Env], int]] = {
    "gridworld": (GridWorld, 64),
    "sokoban": (Sokoban, 64),
    "sim_env": (SimulatedEnv, 8),
    "tool_use": (ToolUse, 64),
}


def known_tasks() -> list[str]:
    """Names `make_task` accepts, sorted."""
    return sorted([*_TASKS, *_ENVIRONMENTS])


def _parameters(factory: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(factory).parameters if p != "self"]


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build the task `name` with constructor keyword arguments `params`.

    Raises BadInput (a ValueError) naming the known tasks for an unknown name, and naming the key
    (and the accepted keys) for an unknown parameter, before the constructor runs; a ValueError
    of the constructor (a parameter out of range) becomes BadInput too, as the parameters are
    what it checked.
    """
    if name not in known_tasks():
        raise BadInput(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    params = dict(params or {})
    if name in _TASKS:
        accepted = _parameters(_TASKS[name])
    else:
        env_class, heldout_size = _ENVIRONMENTS[name]
        accepted = [*_parameters(env_class), "heldout_size"]
    for key in params:
        if key not in accepted:
            raise BadInput(
                f"unknown parameter {key!r} for task {name!r}; accepted: {', '.join(accepted)}"
            )
    if name in _TASKS:
        try:
            return _TASKS[name](**params)
        except BadInput:
            raise
        except ValueError as e:
            raise BadInput(f"task.params ({name}): {e}") from e
    heldout_size = params.pop("heldout_size", heldout_size)
    return EnvTask(name, functools.partial(env_class, **params), heldout_size)


def task_from_config(cfg: Any) -> Task:
    """The task of a run config (`task:`), scored by `reward.functions` when it names any; the
    learner and every generator build it this way. Reward-function import errors raise here."""
    task = make_task(cfg.task.name, cfg.task.params)
    reward = cfg.reward
    if isinstance(task, MixtureTask):
        if reward.functions:
            raise BadInput(
                "reward.functions: a mixture's rewards are set per component "
                "(task.params.components[i].reward)"
                if cfg.task.name == "mixture"
                else f"reward.functions: task {cfg.task.name!r} is scored by its datasets' own "
                "score_answer"
            )
        task.use_reward_functions(reward)
    if not reward.functions:
        return task
    if is_multi_turn(task):
        raise BadInput(
            f"reward.functions: score single responses; multi-turn task {cfg.task.name!r} is "
            "scored by its environment"
        )
    return ScoredTask(
        task, RewardFunctions.load(reward.functions, reward.weights, reward.timeout_s, reward)
    )
