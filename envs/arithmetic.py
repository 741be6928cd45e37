"""Verifiable integer arithmetic: prompts like "17+25=", answers like "42".

Problems are triples (a, op, b) with a, b drawn uniformly from inclusive ranges and op uniformly from
`ops`. The held-out set is `heldout_size` distinct triples drawn with a fixed seed (`heldout_seed`);
every train stream skips those triples, so train and held-out never share a problem, whatever the seed.

Reward (exact rule; `response` is the text after the prompt with EOS already stripped):

    correct     = response == answer                       (no stripping: " 42" is wrong)
    well_formed = re.fullmatch(r"-?[0-9]+", response) and len(response) <= max_answer_len
    reward      = 1.0 * correct + format_reward * well_formed

`max_answer_len` is the longest answer the ranges allow (sign included), so a run-on digit string that
hit `max_new_tokens` without EOS is not "well formed". With the default format_reward=0.1: correct ->
1.1, wrong but well formed -> 0.1, anything else -> 0.0. The format term gives a group with no correct
sample some signal towards "write a short number and stop".
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence

from rollflash.envs.base import Item
from rollflash.envs.generated import GeneratedProblems

logger = logging.getLogger(__name__)

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_INTEGER = re.compile(r"-?[0-9]+")

Problem = tuple[int, str, int]


def _as_range(key: str, value: Sequence[int]) -> tuple[int, int]:
    """Validate an inclusive [lo, hi] range of non-negative ints (lists come from YAML)."""
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"{key} must be [lo, hi] with ints, got {value!r}")
    lo, hi = int(value[0]), int(value[1])
    if not 0 <= lo <= hi:
        raise ValueError(f"{key} must satisfy 0 <= lo <= hi, got {value!r}")
    return lo, hi


class ArithmeticTask(GeneratedProblems[Problem]):
    """Integer "a<op>b=" problems with an exact-match reward plus a small format reward."""

    name = "arithmetic"

    def __init__(
        self,
        ops: Sequence[str] = ("+", "-"),
        a_range: Sequence[int] = (0, 99),
        b_range: Sequence[int] = (0, 99),
        heldout_size: int = 200,
        heldout_seed: int = 1234,
        format_reward: float = 0.1,
    ) -> None:
        """ops: subset of "+", "-", "*"; ranges: inclusive [lo, hi], lo >= 0; heldout_size: problems
        kept out of training (at most half of all problems, so train keeps plenty); format_reward: bonus
        for a well-formed integer (see module docstring)."""
        unknown = [op for op in ops if op not in _OPS]
        if not ops or unknown:
            raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)!r}")
        self.ops = tuple(dict.fromkeys(ops))
        self.a_range = _as_range("a_range", a_range)
        self.b_range = _as_range("b_range", b_range)
        n_problems = len(self.ops) * self._span(self.a_range) * self._span(self.b_range)
        self._set_heldout(n_problems, heldout_size, heldout_seed)
        if format_reward < 0:
            raise ValueError(f"format_reward must be >= 0, got {format_reward}")
        self.format_reward = float(format_reward)
        self.max_answer_len = self._max_answer_len()

    @staticmethod
    def _span(r: tuple[int, int]) -> int:
        return r[1] - r[0] + 1

    def _max_answer_len(self) -> int:
        # |a op b| is extreme at a corner of the ranges for +, - and * on non-negative operands.
        corners = [(a, b) for a in self.a_range for b in self.b_range]
        return max(len(str(_OPS[op](a, b))) for op in self.ops for a, b in corners)

    def _draw(self, rng: random.Random) -> Problem:
        return (rng.randint(*self.a_range), rng.choice(self.ops), rng.randint(*self.b_range))

    @staticmethod
    def _item(item_id: str, problem: Problem) -> Item:
        a, op, b = problem
        return Item(id=item_id, prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)))

    def reference_response(self, item: Item) -> str:
        """A right response: the answer itself (envs/answers.py)."""
        return item.answer

    def score(self, item: Item, response: str) -> float:
        """1.0 for an exact answer plus format_reward for a well-formed integer (module docstring)."""
        correct = response == item.answer
        well_formed = (
            _INTEGER.fullmatch(response) is not None and len(response) <= self.max_answer_len
        )
        return 1.0 * correct + self.format_reward * well_formed
