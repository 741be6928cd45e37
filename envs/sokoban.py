"""A small Sokoban-like puzzle: push one box onto its target.

A room of `width` x `height` floor cells is surrounded by walls. Each seed builds a level by reverse
play, the way gym-sokoban does: the box starts on the target with the player beside it, and
`pull_steps` random reverse moves (the player walks, or steps back pulling the box after it) scatter
them; replaying those moves forwards solves the level, so every level is solvable. A level whose
box ends on the target is redrawn.

Observation: the room, rows joined by "/", then "?", in the usual Sokoban symbols: `#` wall,
`_` floor, `.` target, `$` box, `*` box on target, `@` player, `+` player on target.
Action: "u", "d", "l" or "r". The player moves into free floor, or pushes the box one cell if the
cell behind it is free; a blocked move does nothing. Anything else is invalid (no effect,
observation prefixed "invalid ", reward `invalid_reward`).
Rewards: 1.0 when the box reaches the target (done, success), otherwise `step_reward` (default
-0.01, a small time penalty as gym-sokoban's -0.1 scaled to a 1.0 solve reward). Truncated after
`max_turns` turns.
"""

from __future__ import annotations

import random

from rollflash.envs.gridworld import MOVES, Cell, MoveGame
from rollflash.envs.multiturn import StepResult, check_positive


class Sokoban(MoveGame):
    def __init__(
        self,
        width: int = 4,
        height: int = 4,
        pull_steps: int = 12,
        max_turns: int = 16,
        step_reward: float = -0.01,
        invalid_reward: float = -0.01,
    ) -> None:
        self.width, self.height = check_positive("width", width), check_positive("height", height)
        if width * height < 4 or min(width, height) < 2:
            raise ValueError(f"the room must be at least 2 x 2, got {width} x {height}")
        self.pull_steps = check_positive("pull_steps", pull_steps)
        super().__init__(max_turns, step_reward, invalid_reward)
        self.target: Cell = (0, 0)
        self.box: Cell = (0, 0)
        self.player: Cell = (0, 0)

    def _free(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.height and 0 <= cell[1] < self.width

    def reset(self, seed: int) -> str:
        self._start()
        rng = random.Random(seed)
        cells = [(r, c) for r in range(self.height) for c in range(self.width)]
        while True:
            self.target = self.box = rng.choice(cells)
            beside = [(self.box[0] + dr, self.box[1] + dc) for dr, dc in MOVES.values()]
            self.player = rng.choice([c for c in beside if self._free(c)])
            for _ in range(self.pull_steps):
                self._reverse_move(rng)
            if self.box != self.target:
                return self.render()

    def _reverse_move(self, rng: random.Random) -> None:
        """One random step of reverse play: walk, or (if the box is right behind) pull it along."""
        dr, dc = MOVES[rng.choice("udlr")]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if not self._free(nxt) or nxt == self.box:
            return
        behind = (self.player[0] - dr, self.player[1] - dc)
        if behind == self.box and rng.random() < 0.7:
            self.box = self.player
        self.player = nxt

    def render(self) -> str:
        rows = ["#" * (self.width + 2)]
        for r in range(self.height):
            row = "#"
            for c in range(self.width):
                cell, on_target = (r, c), (r, c) == self.target
                if cell == self.player:
                    row += "+" if on_target else "@"
                elif cell == self.box:
                    row += "*" if on_target else "$"
                else:
                    row += "." if on_target else "_"
            rows.append(row + "#")
        rows.append("#" * (self.width + 2))
        return "/".join(rows) + "?"

    def _move(self, dr: int, dc: int) -> StepResult:
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if nxt == self.box:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if self._free(beyond):
                self.box, self.player = beyond, nxt
        elif self._free(nxt):
            self.player = nxt
        if self.box == self.target:
            return self._finish("", 1.0, True, success=True)
        return self._finish(self.render(), self.step_reward, False)
