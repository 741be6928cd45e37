"""The learning-rate schedule every trainer here uses: linear warm-up, then constant or cosine decay.

    multiplier(step) = (step + 1) / warmup                                   while step < warmup
                     = floor + (1 - floor) * 0.5 * (1 + cos(pi * p))        cosine, after warm-up
                     = 1                                                     constant, after warm-up
    p = min(1, (step - warmup) / max(1, total - warmup))

`step` is torch's LambdaLR count: 0 for the first optimiser step, stepped after each one. The learner
(`trainer.lr_warmup_steps`, `trainer.lr_schedule`, floor 0), the reward-model trainer and
scripts/make_tiny_model.py (both with a 0.1 floor) share it.

Why not transformers' `get_cosine_schedule_with_warmup` / `get_constant_schedule_with_warmup`: their
warm-up multiplier is step / warmup, so the first optimiser step runs at lr 0 and is wasted; here
it is (step + 1) / warmup, which every step of the warm-up uses. The cosine part is the same as
theirs with `min_lr_rate = floor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal


def warmup_decay(
    warmup: int,
    total: int,
    decay: Literal["constant", "cosine"] = "cosine",
    floor: float = 0.0,
) -> Callable[[int], float]:
    """The lr multiplier of LambdaLR step `step` (see the module docstring); `warmup` 0 starts at
    the full rate, `floor` is where the cosine ends at step `total`."""

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier
