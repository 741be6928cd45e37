"""A task scored by the run's reward functions (`reward.functions`, envs/reward_functions.py):
the wrapped task's prompts, held-out set and environments, the functions' reward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rollflash.envs.answers import final_answer
from rollflash.envs.base import Item, Task
from rollflash.envs.reward_functions import RewardFunctions
from rollflash.envs.verifiers import math_answer


class ScoredTask:
    """A task whose rule reward is the configured reward functions: everything else (prompts,
    held-out set, environments) is the wrapped task's."""

    def __init__(self, task: Task, functions: RewardFunctions):
        self.task, self.functions = task, functions
        self.name = task.name
        expect = getattr(task, "expect_answers", None)  # a dataset: is a row without one bad?
        if expect is not None:
            expect(functions.needs_answer)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.task, attr)

    def train_items(self, seed: int, start: int = 0) -> Iterator[Item]:
        from rollflash.envs.base import train_stream

        return train_stream(self.task, seed, start)

    def heldout_items(self) -> list[Item]:
        return self.task.heldout_items()

    def final_answer(self, item_id: str, response: str) -> str:
        """The response's final answer (envs/answers.py): as the `math` verifier reads it when
        it is one of the functions, else as the wrapped task reads it."""
        if "math" in self.functions.specs:
            return math_answer(response)
        return final_answer(self.task, item_id, response)

    def reference_response(self, item: Item) -> str | None:
        """The row's answer, as a response (envs/answers.py); None when a function reads the
        answer as something else than the response it expects (a pattern, a schema, tests, a
        judge's reference)."""
        if set(self.functions.specs) & {"code", "judge", "regex", "json_schema"}:
            return None
        return item.answer

    def score(self, item: Item, response: str) -> float:
        return self.functions.score_flat([item], [response])[0]

    def score_groups(self, items: list[Item], groups: list[list[str]]) -> list[list[float]]:
        """Rewards of each item's responses, shaped like `groups`, in one batch."""
        flat = self.functions.score_flat(
            [it for it, g in zip(items, groups) for _ in g], [r for g in groups for r in g]
        )
        out, k = [], 0
        for g in groups:
            out.append(flat[k : k + len(g)])
            k += len(g)
        return out
