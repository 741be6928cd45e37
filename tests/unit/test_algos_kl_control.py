"""The adaptive KL coefficient (Ziegler et al. 2019) and the Bradley-Terry preference loss."""

import math

import pytest
import torch

from rollflash.algos import adaptive_kl_coef, bradley_terry_loss, next_kl_coef


def test_adaptive_kl_hand_worked():
    # KL 0.15 vs target 0.1: e = 0.15 / 0.1 - 1 = 0.5 -> clipped to 0.2; 256 samples of 10 000:
    # beta = 0.05 * (1 + 0.2 * 256 / 10000) = 0.05 * 1.00512 = 0.050256
    assert adaptive_kl_coef(0.05, 0.15, 0.1, 10000, 256) == pytest.approx(0.050256, abs=1e-9)
    # KL 0.09: e = -0.1 (inside the clip); beta = 0.05 * (1 - 0.1 * 0.0256) = 0.049872
    assert adaptive_kl_coef(0.05, 0.09, 0.1, 10000, 256) == pytest.approx(0.049872, abs=1e-9)
    # KL 0: e = -1 -> clipped to -0.2; beta = 0.05 * (1 - 0.2 * 0.0256) = 0.049744
    assert adaptive_kl_coef(0.05, 0.0, 0.1, 10000, 256) == pytest.approx(0.049744, abs=1e-9)


def test_adaptive_kl_on_target_and_over_a_horizon():
    assert adaptive_kl_coef(0.05, 0.1, 0.1, 10000, 256) == pytest.approx(0.05, abs=1e-12)
    # one horizon of samples at the clip: at most x1.2 in one step of n = horizon
    assert adaptive_kl_coef(1.0, 10.0, 0.1, 100, 100) == pytest.approx(1.2)
    # many small steps above the target compound: (1 + 0.2 / 100) ^ 100 = 1.2211
    beta = 1.0
    for _ in range(100):
        beta = adaptive_kl_coef(beta, 10.0, 0.1, 100, 1)
    assert beta == pytest.approx(1.002**100, rel=1e-9)
    assert beta == pytest.approx(1.2211, abs=1e-4)


def test_fixed_and_nonfinite_and_bad_arguments():
    assert next_kl_coef(0.05, 3.0, None, 10000, 256) == 0.05  # fixed coefficient
    assert next_kl_coef(0.05, math.nan, 0.1, 10000, 256) == 0.05  # no KL measured: unchanged
    with pytest.raises(ValueError, match="coef"):
        adaptive_kl_coef(0.0, 0.1, 0.1, 10000, 1)


def test_bradley_terry_hand_worked():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5])
    out = bradley_terry_loss(chosen, rejected)
    # margins 1.0 and -0.5: -log sigmoid(1) = 0.31326, -log sigmoid(-0.5) = 0.97408; mean 0.64367
    torch.testing.assert_close(out.loss, torch.tensor(0.64367), atol=1e-5, rtol=0)
    assert float(out.metrics["rm/acc"]) == 0.5
    torch.testing.assert_close(out.metrics["rm/margin"], torch.tensor(0.25))


def test_bradley_terry_gradient_and_ties():
    chosen = torch.tensor([0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 3.0], requires_grad=True)
    out = bradley_terry_loss(chosen, rejected)
    out.loss.backward()
    # d/dc of -log sigmoid(c - r) / P = -(1 - sigmoid(c - r)) / 2: margin 0 -> -0.25, -2 -> -0.44040
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.25, -0.44040]), atol=1e-5, rtol=0)
    torch.testing.assert_close(rejected.grad, -chosen.grad)
    assert float(out.metrics["rm/acc"]) == 0.0  # a tie counts as wrong


def test_bradley_terry_matches_a_slow_loop_and_handles_empty():
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(7, generator=g), torch.randn(7, generator=g)
    slow = sum(-math.log(1 / (1 + math.exp(-(a - b)))) for a, b in zip(c.tolist(), r.tolist())) / 7
    torch.testing.assert_close(bradley_terry_loss(c, r).loss, torch.tensor(slow), atol=1e-5, rtol=0)
    empty = bradley_terry_loss(torch.zeros(0), torch.zeros(0))
    assert float(empty.loss) == 0.0
    with pytest.raises(ValueError, match="both be"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
