"""The multi-turn environment interface, and the adapter that makes an environment a task.

An environment is a gymnasium-style text game (in the spirit of gymnasium and GEM):

    observation = env.reset(seed)                             # the same seed gives the same episode
    result      = env.step(action_text)                       # StepResult(observation, reward, done, info)

`action_text` is what the model wrote in one turn (the generator strips EOS); the environment parses
it itself, so a malformed action is the environment's to punish (usually: no effect, an error
observation, and the turn counts). An episode ends when the environment says `done`: the task is
solved or failed (`info["success"]` says which), or the turn limit `max_turns` is reached
(`info["truncated"] = True`, as gymnasium's TimeLimit). Rewards are per turn; an episode's score is
their undiscounted sum.

`EnvTask` turns an environment into a `Task` the learner can issue prompts from: a train item is one
episode seed, the held-out set is a fixed list of seeds no train stream draws. Because the item must
stay a plain `Item`, its `answer` field carries the episode seed (as a decimal string) and its
`prompt` the first observation, which is readable in `redis-cli XRANGE`. The generator rebuilds the
episode from the seed; it never scores a single response (`score` raises).

Stdlib only, like the rest of envs/.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

from rollflash.envs.base import Item

HELDOUT_SEED_BASE = 1_000_000_000  # held-out seeds are BASE, BASE+1, ...; train seeds lie below it


@dataclass
class StepResult:
    observation: str  # text shown to the model before its next turn ("" once done)
    reward: float  # reward of this turn
    done: bool  # the episode is over (solved, failed or out of turns)
    info: dict[str, Any] = field(default_factory=dict)  # "success", "truncated", "invalid", ...


@runtime_checkable
class Env(Protocol):
    """A multi-turn text environment. Instances are used by one episode at a time."""

    max_turns: int  # the episode ends (truncated) after this many turns

    def reset(self, seed: int) -> str:
        """Start a new episode; returns the first observation. Deterministic in `seed`."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply one turn's action text; after `done` only `reset` may be called."""
        ...

    def close(self) -> None:
        """Release anything the environment holds (subprocesses, scratch directories)."""
        ...


class TurnLimit:
    """Mixin that counts turns and ends the episode at `max_turns` with info["truncated"].

    It owns the parameters the environments share: `max_turns`, the reward of a turn that goes on
    (`step_reward`) and that of an invalid action (`invalid_reward`). An environment lists them in
    its own signature, with its own defaults (envs/catalog.py reads the accepted keys from there),
    and passes them to `__init__`, which checks them."""

    max_turns: int
    turns: int = 0

    def __init__(
        self, max_turns: int, step_reward: float = 0.0, invalid_reward: float = 0.0
    ) -> None:
        self.max_turns = check_positive("max_turns", max_turns)
        self.step_reward, self.invalid_reward = float(step_reward), float(invalid_reward)

    def _start(self) -> None:
        self.turns = 0

    def _finish(self, observation: str, reward: float, done: bool, **info: Any) -> StepResult:
        self.turns += 1
        info.setdefault("success", False)
        if not done and self.turns >= self.max_turns:
            done, info["truncated"] = True, True
        return StepResult(
            observation="" if done else observation, reward=float(reward), done=done, info=info
        )

    def close(self) -> None:
        pass


def check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class EnvTask:
    """A `Task` whose items are episode seeds of the environment `make_env()` builds."""

    multi_turn = True

    def __init__(self, name: str, make_env: Callable[[], Env], heldout_size: int = 64) -> None:
        self.name = name
        self._make_env = make_env
        self.heldout_size = check_positive("heldout_size", heldout_size)
        make_env().close()  # validates the parameters now, at config load, not in a generator

    def make_env(self) -> Env:
        return self._make_env()

    def _item(self, item_id: str, seed: int) -> Item:
        env = self.make_env()
        try:
            return Item(id=item_id, prompt=env.reset(seed), answer=str(seed))
        finally:
            env.close()

    def train_items(self, seed: int) -> Iterator[Item]:
        """Endless episode seeds in [0, HELDOUT_SEED_BASE), drawn from random.Random(seed)."""
        rng = random.Random(seed)
        index = 0
        while True:
            yield self._item(f"train-{index:06d}", rng.randrange(HELDOUT_SEED_BASE))
            index += 1

    def heldout_items(self) -> list[Item]:
        return [
            self._item(f"heldout-{i:04d}", HELDOUT_SEED_BASE + i) for i in range(self.heldout_size)
        ]

    def score(self, item: Item, response: str) -> float:
        raise TypeError(
            f"task {self.name!r} is a multi-turn environment: run episodes "
            "(envs.episode.Episode) instead of scoring one response"
        )


def is_multi_turn(task: Any) -> TypeGuard[EnvTask]:
    """Whether `task` runs environment episodes (only an EnvTask says `multi_turn`)."""
    return bool(getattr(task, "multi_turn", False))
