"""A simulated multi-turn environment for scheduling benchmarks (with `rollout.engine: sim`).

It stands in for agentic workloads whose environment steps take real time (a tool call, a game
engine, a web request): each step sleeps for a log-normal latency with median `step_latency_s`
and shape `latency_sigma`, drawn from the episode's random.Random(seed) (so episodes of one group
differ, but the same episode is reproducible). An episode lasts a number of turns drawn uniformly
from [min_turns, max_turns] at its first step, whatever the model writes, which suits the
simulated engine's random tokens. The final turn is a success with probability `success_prob`
(reward 1.0), so groups still have reward variance.

Observations are `obs_chars` characters of filler text.
"""

from __future__ import annotations

import random
import time

from rollflash.envs.multiturn import StepResult, TurnLimit, check_positive


class SimulatedEnv(TurnLimit):
    def __init__(
        self,
        min_turns: int = 2,
        max_turns: int = 6,
        step_latency_s: float = 0.05,
        latency_sigma: float = 1.0,
        obs_chars: int = 16,
        success_prob: float = 0.5,
    ) -> None:
        self.min_turns = check_positive("min_turns", min_turns)
        super().__init__(max_turns)
        if min_turns > max_turns:
            raise ValueError(f"min_turns ({min_turns}) must be <= max_turns ({max_turns})")
        if step_latency_s < 0 or latency_sigma < 0:
            raise ValueError("step_latency_s and latency_sigma must be >= 0")
        if not 0 <= success_prob <= 1:
            raise ValueError(f"success_prob must be in [0, 1], got {success_prob}")
        self.step_latency_s, self.latency_sigma = float(step_latency_s), float(latency_sigma)
        self.obs_chars = check_positive("obs_chars", obs_chars)
        self.success_prob = float(success_prob)
        self.rng = random.Random(0)
        self.length = min_turns

    def reset(self, seed: int) -> str:
        self._start()
        self.rng = random.Random(seed)
        return "o" * self.obs_chars

    def step(self, action: str) -> StepResult:
        if self.step_latency_s > 0:
            time.sleep(self.step_latency_s * self.rng.lognormvariate(0.0, self.latency_sigma))
        if self.turns == 0:
            self.length = self.rng.randint(self.min_turns, self.max_turns)
        if self.turns + 1 >= self.length:
            success = self.rng.random() < self.success_prob
            return self._finish("", 1.0 if success else 0.0, True, success=success)
        return self._finish("o" * self.obs_chars, 0.0, False)
