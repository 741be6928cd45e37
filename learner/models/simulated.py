"""A stand-in policy for scheduling benchmarks (`sim.learner_step_s > 0`).

It keeps the learner's real control loop (admission, collection, staleness filter, publishing,
acknowledgement) and replaces only the model: learner/build.py gives the loop its `train_step`,
which takes the arguments of learner/step/train.py's and sleeps `learner_step_s`; the weights are one
small tensor, and evaluation reports 0. Paired with `rollout.engine: sim`.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from rollflash.broker.config.config import SimConfig


class SimulatedPolicy(torch.nn.Module):
    def __init__(self, sim: SimConfig):
        super().__init__()
        self.sim = sim
        self.config = SimpleNamespace(vocab_size=sim.vocab_size)
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def train_step(self, *step_inputs: object) -> dict[str, float]:
        """One simulated optimiser step; the step's inputs (learner/step/train.py `train_step`'s)
        are not looked at."""
        time.sleep(self.sim.learner_step_s)
        with torch.no_grad():
            self.weight.add_(1.0)  # so every published version differs
        return {"loss/policy": 0.0}
