"""A generated code task: write the Python one-liner that reads x and prints a*x + b.

Item: prompt "code x*7+25=", answer (the reference program) "print(int(input())*7+25)", and
the row column `tests`: one stdin/stdout pair per input of `inputs`, e.g. x = 1 and x = 7:
`{"input": "1\\n", "output": "32\\n"}, {"input": "7\\n", "output": "74\\n"}`. The programs and
tests only use characters of the tiny test tokenizer (scripts/make_tiny_model.py has no newline
in its vocabulary, so the program is one line and the tests' newlines are never tokens).

Reward: the `code` verifier (envs/code_verifier.py) runs the response in the sandbox against the
tests: the fraction passed. In a mixture, give the component `reward: {functions: [code]}` so the
run's `reward.code` limits apply; the task's own `score` uses the default limits. With the
default inputs (1, 7) a program that swaps a and b passes x = 1 only (a + b = b + a) and scores
0.5 (a != b with the default ranges): the partial credit of a near miss.

a, b are drawn uniformly from inclusive ranges, by default a one digit and b two (720 problems):
every prompt and program then has the same length, so a model copies a and b from fixed offsets,
which the two-layer test model learns in a few hundred SFT steps. The held-out set is
`heldout_size` distinct (a, b) drawn with `heldout_seed`, and every train stream skips them (as
envs/arithmetic.py does).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from rollflash.envs.arithmetic import _as_range
from rollflash.envs.base import Item
from rollflash.envs.generated import GeneratedProblems

Problem = tuple[int, int]


def program(a: int, b: int) -> str:
    """The reference one-liner for a*x + b."""
    return f"print(int(input())*{a}+{b})"


class OneLinerTask(GeneratedProblems[Problem]):
    """ "code x*a+b=" -> a one-line program that reads x on stdin and prints a*x + b."""

    name = "oneliner"

    def __init__(
        self,
        a_range: Sequence[int] = (2, 9),
        b_range: Sequence[int] = (10, 99),
        inputs: Sequence[int] = (1, 7),
        heldout_size: int = 200,
        heldout_seed: int = 1234,
    ) -> None:
        """ranges: inclusive [lo, hi], lo >= 0; inputs: the x of each stdin/stdout test (distinct
        ints); heldout_size: problems kept out of training (at most half of all problems)."""
        self.a_range = _as_range("a_range", a_range)
        self.b_range = _as_range("b_range", b_range)
        if (
            not inputs
            or len(set(inputs)) != len(inputs)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in inputs)
        ):
            raise ValueError(f"inputs must be distinct ints, got {list(inputs)!r}")
        self.inputs = tuple(inputs)
        n_problems = (self.a_range[1] - self.a_range[0] + 1) * (
            self.b_range[1] - self.b_range[0] + 1
        )
        self._set_heldout(n_problems, heldout_size, heldout_seed)
        self._verifier: Any = None  # the code verifier, built on first `score`

    def _draw(self, rng: random.Random) -> Problem:
        return rng.randint(*self.a_range), rng.randint(*self.b_range)

    def _item(self, item_id: str, problem: Problem) -> Item:
        a, b = problem
        tests = [{"input": f"{x}\n", "output": f"{a * x + b}\n"} for x in self.inputs]
        return Item(
            id=item_id, prompt=f"code x*{a}+{b}=", answer=program(a, b), extra={"tests": tests}
        )

    def score_groups(self, items: list[Item], groups: list[list[str]]) -> list[list[float]]:
        """The code verifier's rewards (default limits), one batch, shaped like `groups`."""
        if self._verifier is None:
            from rollflash.envs.code_verifier import CodeVerifier

            self._verifier = CodeVerifier()
        flat = self._verifier(
            [it.prompt for it, g in zip(items, groups) for _ in g],
            [r for g in groups for r in g],
            [it.answer for it, g in zip(items, groups) for _ in g],
            tests=[it.extra["tests"] for it, g in zip(items, groups) for _ in g],
        )
        out, k = [], 0
        for g in groups:
            out.append(list(flat[k : k + len(g)]))
            k += len(g)
        return out

    def score(self, item: Item, response: str) -> float:
        """The fraction of the item's tests the response's program passes (module docstring)."""
        return self.score_groups([item], [[response]])[0][0]
