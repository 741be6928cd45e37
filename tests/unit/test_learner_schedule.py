"""The learning-rate schedule (learner/models/schedule.py), by hand, as LambdaLR applies it."""

import math

import pytest
import torch

from rollflash.learner.models.schedule import warmup_decay


def _lrs(multiplier, steps: int, base: float = 1.0) -> list[float]:
    """The lr each of `steps` optimiser steps runs with (scheduler stepped after each one)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_after_warmup_by_hand():
    # warm-up 2, total 10: steps 0, 1 run at 1/2, 2/2; then p = (k - 2) / 8:
    # k = 2: p = 0 -> 1; k = 4: p = 1/4 -> 0.5 * (1 + cos(pi/4)) = 0.8536; k = 6: p = 1/2 -> 0.5;
    # k = 10: p = 1 -> 0; past the end p stays 1 -> 0
    f = warmup_decay(2, 10, "cosine")
    assert (f(0), f(1), f(2), f(6), f(10), f(12)) == (0.5, 1.0, 1.0, 0.5, 0.0, 0.0)
    assert f(4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    assert f(4) == pytest.approx(0.85355, abs=1e-5)
    lrs = _lrs(f, 7, base=0.1)  # what the optimiser sees: the same numbers times the base lr
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.1 * f(3), 0.1 * f(4), 0.1 * f(5), 0.05])


def test_constant_and_no_warmup():
    # warm-up 4 then constant: 1/4, 2/4, 3/4, 4/4, then 1 forever
    assert [warmup_decay(4, 10, "constant")(k) for k in (0, 1, 2, 3, 4, 50)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        1.0,
    ]
    # no warm-up: the first step already runs at the full rate
    assert warmup_decay(0, 10, "constant")(0) == 1.0 and warmup_decay(0, 10, "cosine")(0) == 1.0


def test_floor():
    # floor 0.1, warm-up 1, total 11: k = 6 -> p = 1/2 -> 0.1 + 0.9 * 0.5 = 0.55; k = 11 -> 0.1
    f = warmup_decay(1, 11, "cosine", floor=0.1)
    assert f(0) == 1.0 and f(6) == pytest.approx(0.55, abs=1e-12)
    assert f(11) == pytest.approx(0.1, abs=1e-12)
