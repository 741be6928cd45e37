"""What the generated tasks (envs/arithmetic.py, envs/oneliner.py) share: problems drawn from
random.Random, a fixed held-out set of distinct problems, and endless train streams that skip it.

A subclass defines `_draw(rng)` (one problem, hashable) and `_item(item_id, problem)` (its Item),
and calls `_set_heldout` from its constructor once the ranges that `_draw` reads are set.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from rollflash.envs.base import Item

P = TypeVar("P", bound=Hashable)  # one problem


class GeneratedProblems(Generic[P]):
    _heldout: list[P]
    _heldout_set: frozenset[P]

    def _draw(self, rng: random.Random) -> P:
        raise NotImplementedError

    def _item(self, item_id: str, problem: P) -> Item:
        raise NotImplementedError

    def _set_heldout(self, n_problems: int, size: int, seed: int) -> None:
        """`size` distinct problems drawn with `seed`, at most half of all `n_problems` (so that
        training keeps plenty)."""
        if not 0 < size <= n_problems // 2:
            raise ValueError(
                f"heldout_size must be in [1, {n_problems // 2}] (half of {n_problems} problems), "
                f"got {size}"
            )
        rng, seen, out = random.Random(seed), set[P](), list[P]()
        while len(out) < size:
            problem = self._draw(rng)
            if problem not in seen:
                seen.add(problem)
                out.append(problem)
        self._heldout, self._heldout_set = out, frozenset(out)

    def train_items(self, seed: int) -> Iterator[Item]:
        """Endless i.i.d. problems (repeats allowed) from random.Random(seed), skipping held-out
        ones."""
        rng = random.Random(seed)
        index = 0
        while True:
            problem = self._draw(rng)
            if problem in self._heldout_set:
                continue
            yield self._item(f"train-{index:06d}", problem)
            index += 1

    def heldout_items(self) -> list[Item]:
        """The fixed evaluation set, ids "heldout-0000" ... in draw order."""
        return [self._item(f"heldout-{i:04d}", p) for i, p in enumerate(self._heldout)]
