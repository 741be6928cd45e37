"""A gradient whose norm is not finite is not stepped on (learner/step/train.py): the update is skipped,
its gradient dropped, the step counts it in `optim/nonfinite_skipped` and a warning says so; the
other updates of the step go on as if it had not been there. Hand-worked on the two-token model of
tests/unit/test_ppo_updates.py."""

from __future__ import annotations

import logging

import pytest
import torch

from rollflash.learner.step.prepare import build_algo_models
from rollflash.learner.step.train import train_step
from tests.unit.test_ppo_updates import TwoTokenLM, _group, _toy_cfg


def _poison_first_backward(param: torch.nn.Parameter, value: float) -> None:
    calls = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad * value if len(calls) == 1 else grad

    param.register_hook(hook)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_update_is_skipped_counted_and_logged(poison, caplog):
    # M = 2: update 1 (group 0) gets a NaN / inf gradient and is skipped, so update 2 (group 1)
    # starts at w = 0 with ratio 1: dL/dw = [-0.25, 0.25] (test_ppo_updates' update 1), and
    # w = -lr * dL/dw = [0.25 lr, -0.25 lr] with lr = 0.8: [0.2, -0.2]
    model = TwoTokenLM()
    groups = [_group(0, model.w), _group(1, model.w)]
    _poison_first_backward(model.w, poison)
    opt = torch.optim.SGD(model.parameters(), lr=0.8)
    with caplog.at_level(logging.WARNING, logger="rollflash.learner.step.train"):
        stats = train_step(
            model, opt, groups, _toy_cfg(ppo_mini_batches=2), build_algo_models(_toy_cfg())
        )
    torch.testing.assert_close(model.w.detach(), torch.tensor([0.2, -0.2]), atol=1e-6, rtol=0)
    assert stats["optim/nonfinite_skipped"] == 1.0 and stats["optim/updates"] == 2.0
    assert any("update skipped" in r.getMessage() for r in caplog.records)


def test_finite_updates_are_all_stepped():
    model = TwoTokenLM()
    groups = [_group(0, model.w), _group(1, model.w)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    stats = train_step(
        model, opt, groups, _toy_cfg(ppo_mini_batches=2), build_algo_models(_toy_cfg())
    )
    assert stats["optim/nonfinite_skipped"] == 0.0
    assert opt.state[model.w]["step"] == 2  # both updates stepped
