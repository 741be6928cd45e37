"""A text grid world in the spirit of gymnasium's FrozenLake.

The agent starts in the top-left corner and must reach the goal in the bottom-right corner of a
`size` x `size` grid without stepping into a hole. Each seed draws `holes` holes uniformly among the
other cells, redrawing until a path exists (so every episode is solvable).

Observation: the grid, rows joined by "/", then "?": "a..h/.h../..../h..g?" where `a` is the
agent, `h` a hole, `g` the goal and `.` frozen ground (all characters of the tiny models' tokenizer,
and no spaces: the tiny tokenizer as reloaded by AutoTokenizer drops them).
Action: one of "u", "d", "l", "r" (leading/trailing whitespace ignored). Dynamics:
- a move off the grid leaves the agent in place;
- with `slip` > 0 the move is replaced by a uniformly random one with that probability (FrozenLake's
  slippery ice, drawn from the episode's own random.Random(seed));
- anything else is invalid: the agent stays, the observation is prefixed "invalid ", and the turn
  gets `invalid_reward`.
Rewards: 1.0 on reaching the goal (done, success), 0.0 on falling into a hole (done), otherwise
`step_reward` (default 0, as FrozenLake). After `max_turns` turns the episode is truncated.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import deque

from rollflash.envs.multiturn import StepResult, TurnLimit, check_positive

Cell = tuple[int, int]  # (row, column)
MOVES = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}


def solvable(size: int, holes: set[Cell]) -> bool:
    """A path of non-hole cells joins (0, 0) and (size-1, size-1) (breadth-first search)."""
    goal, seen, todo = (size - 1, size - 1), {(0, 0)}, deque([(0, 0)])
    while todo:
        cell = todo.popleft()
        if cell == goal:
            return True
        for dr, dc in MOVES.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def shortest_action(size: int, holes: set[Cell], pos: Cell) -> str | None:
    """The first action of a shortest safe path from `pos` to the goal (ties: order "d","r","u","l"),
    or None if there is none. Used to build warm-start demonstrations and in tests."""
    goal = (size - 1, size - 1)
    if pos == goal:
        return None
    first: dict[Cell, str | None] = {pos: None}
    todo = deque([pos])
    while todo:
        cell = todo.popleft()
        for action in "drul":
            dr, dc = MOVES[action]
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in first:
                first[nxt] = first[cell] or action
                if nxt == goal:
                    return first[nxt]
                todo.append(nxt)
    return None


class MoveGame(TurnLimit, ABC):
    """A board game played with the four `MOVES`. An action that is not one of them (white space
    around it aside) is invalid: nothing moves, the observation is the board prefixed "invalid ",
    and the turn gets `invalid_reward`."""

    @abstractmethod
    def render(self) -> str:
        """The board, as the observation shows it."""

    @abstractmethod
    def _move(self, dr: int, dc: int) -> StepResult:
        """Play one valid move (a row and a column step) and finish the turn."""

    def step(self, action: str) -> StepResult:
        move = MOVES.get(action.strip())
        if move is None:
            return self._finish(
                "invalid " + self.render(), self.invalid_reward, False, invalid=True
            )
        return self._move(*move)


class GridWorld(MoveGame):
    """FrozenLake-like grid world; see the module docstring for observations, actions and rewards."""

    def __init__(
        self,
        size: int = 4,
        holes: int = 3,
        max_turns: int = 8,
        slip: float = 0.0,
        step_reward: float = 0.0,
        invalid_reward: float = 0.0,
    ) -> None:
        self.size = check_positive("size", size)
        if size < 2:
            raise ValueError(f"size must be >= 2, got {size}")
        if not 0 <= holes <= (size - 1) ** 2 // 2:  # dense enough maps are rarely solvable
            raise ValueError(
                f"holes must be in [0, {(size - 1) ** 2 // 2}] for size {size}, got {holes}"
            )
        if not 0.0 <= slip < 1.0:
            raise ValueError(f"slip must be in [0, 1), got {slip}")
        self.n_holes, self.slip = holes, float(slip)
        super().__init__(max_turns, step_reward, invalid_reward)
        self.holes: set[Cell] = set()
        self.pos = (0, 0)
        self.rng = random.Random(0)

    def reset(self, seed: int) -> str:
        self._start()
        self.rng = random.Random(seed)
        cells = [
            (r, c)
            for r in range(self.size)
            for c in range(self.size)
            if (r, c) not in ((0, 0), (self.size - 1, self.size - 1))
        ]
        while True:
            self.holes = set(self.rng.sample(cells, self.n_holes))
            if solvable(self.size, self.holes):
                break
        self.pos = (0, 0)
        return self.render()

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                row += (
                    "a"
                    if (r, c) == self.pos
                    else "h"
                    if (r, c) in self.holes
                    else "g"
                    if (r, c) == (self.size - 1, self.size - 1)
                    else "."
                )
            rows.append(row)
        return "/".join(rows) + "?"

    def _move(self, dr: int, dc: int) -> StepResult:
        if self.slip and self.rng.random() < self.slip:
            dr, dc = MOVES[self.rng.choice(sorted(MOVES))]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.pos = (r, c)
        if self.pos in self.holes:
            return self._finish("", 0.0, True, hole=True)
        if self.pos == (self.size - 1, self.size - 1):
            return self._finish("", 1.0, True, success=True)
        return self._finish(self.render(), self.step_reward, False)
