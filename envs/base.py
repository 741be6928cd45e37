"""The task interface every environment implements.

A task hands out prompts (`Item`s) and scores what the model wrote after a prompt. The generator calls
`score(item, response)` where `response` is the decoded text the model produced after the prompt, up to
(not including) the end-of-sequence token: the generator strips EOS before scoring. A response that ran
out of `max_new_tokens` without EOS is passed as-is, so a task can penalise it through its format rule.

Stdlib only: the generator and learner both import `envs/`, and neither should pull torch in through it.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Item:
    """One prompt of a task, with its ground truth."""

    id: str  # stable id, e.g. "train-000123" / "heldout-0042"
    prompt: str  # text given to the model, e.g. "17+25="
    answer: str  # ground truth, e.g. "42"
    # other columns of a dataset row (msgpack types), passed to reward functions as keywords
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


@runtime_checkable
class Task(Protocol):
    """What the learner (prompt source, evaluation) and generators (reward) need from a task."""

    name: str

    def train_items(self, seed: int) -> Iterator[Item]:
        """Endless stream of training prompts; the same seed yields the same sequence."""
        ...

    def heldout_items(self) -> list[Item]:
        """Fixed evaluation set, disjoint from every train stream (independent of any seed)."""
        ...

    def score(self, item: Item, response: str) -> float:
        """Reward of `response` (text after the prompt, EOS stripped) for `item`."""
        ...


def train_stream(task: Task, seed: int, start: int = 0) -> Iterator[Item]:
    """`task.train_items(seed)` from its `start`-th item on: how the learner resumes the prompt
    position. A task whose `train_items` takes `start` (a dataset) jumps there; any other is
    advanced item by item, which is the same sequence."""
    if "start" in inspect.signature(task.train_items).parameters:
        return task.train_items(seed, start=start)  # type: ignore[call-arg]
    return itertools.islice(task.train_items(seed), start, None)


def response_text(tokenizer: Any, ids: list[int], eos_id: int | None) -> str:
    """The text a task scores: the response up to its first EOS, every other special token kept as
    written, so that "4<pad>2" is not read as "42" (skipping them would let a policy game the
    reward). `tokenizer` is anything with `decode(ids, skip_special_tokens=...)`."""
    if eos_id is not None and eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return tokenizer.decode(ids, skip_special_tokens=False)
