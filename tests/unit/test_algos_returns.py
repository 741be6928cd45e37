"""Terminal reward placement, discounted returns, GAE, REINFORCE++ and the token-level estimators."""

import pytest
import torch

from rollflash.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageInputs
from rollflash.algos.returns import discounted_returns, gae_advantages, place_terminal_reward

T_, F_ = True, False


def test_place_terminal_reward():
    # row0 last selected index 1; row1 has a hole, last selected index 2; row2 empty -> nothing
    mask = torch.tensor([[T_, T_, F_], [T_, F_, T_], [F_, F_, F_]])
    out = place_terminal_reward(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(
        out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    )


def test_discounted_returns_hand_worked():
    # G2 = 1; G1 = 0 + 0.9 * 1 = 0.9; G0 = 0.9 * 0.9 = 0.81; masked position 3 is 0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    out = discounted_returns(rewards, torch.tensor([[T_, T_, T_, F_]]), gamma=0.9)
    torch.testing.assert_close(out, torch.tensor([[0.81, 0.9, 1.0, 0.0]]))


def test_gae_hand_worked():
    # gamma 0.9, lam 0.8 -> gamma * lam = 0.72
    # t2: delta = 1 + 0.9 * 0 - 0.7 = 0.3;           A2 = 0.3
    # t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03;        A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04;        A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(
        rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_skips_holes_and_padding():
    # row0: hole at t1 (env tokens; its value 99 and reward 5 ignored):
    #   t2: A = 1 - 0.7 = 0.3; t0: delta = 0.9 * 0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72 * 0.3 = 0.346
    # row1: right padding at t2: t1: delta = 1 - 0.6 = 0.4; t0: delta = 0.9 * 0.6 - 0.5 = 0.04;
    #   A0 = 0.04 + 0.72 * 0.4 = 0.328
    rewards = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 99.0, 0.7], [0.5, 0.6, float("nan")]])
    mask = torch.tensor([[T_, F_, T_], [T_, T_, F_]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.3], [0.328, 0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.846, 0.0, 1.0], [0.828, 1.0, 0.0]]))


def _reference_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_v = values[b, t].item()
    return adv


def test_gae_matches_reference_loop():
    g = torch.Generator().manual_seed(6)
    rewards = torch.randn(5, 11, generator=g)
    values = torch.randn(5, 11, generator=g)
    mask = torch.rand(5, 11, generator=g) < 0.7
    mask[2] = False
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    expected = _reference_gae(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, torch.zeros(())))


def test_gae_estimator_uses_terminal_score_and_dense_rewards():
    # score 1 on the last token, dense -0.1 on t0; gamma = lam = 1, values 0:
    # A1 = 1; A0 = -0.1 + A1 = 0.9
    x = AdvantageInputs(
        scores=torch.tensor([1.0]),
        mask=torch.ones(1, 2, dtype=torch.bool),
        group_size=1,
        values=torch.zeros(1, 2),
        token_rewards=torch.tensor([[-0.1, 0.0]]),
    )
    out = ADVANTAGE_ESTIMATORS["gae"](x, AdvantageConfig(gamma=1.0, lam=1.0))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.9, 1.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.9, 1.0]]))


def test_gae_estimator_without_values_is_an_error():
    x = AdvantageInputs(torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), group_size=1)
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGE_ESTIMATORS["gae"](x, AdvantageConfig())


def test_reinforce_pp_whitens_over_the_batch():
    # one token each, gamma 1: returns = scores 1, 0, 3, 3; mean 1.75;
    # unbiased var = (0.5625 + 3.0625 + 1.5625 + 1.5625) / 3 = 2.25 -> std 1.5
    # A = (-0.75, -1.75, 1.25, 1.25) / 1.5 = -0.5, -1.16667, 0.83333, 0.83333
    x = AdvantageInputs(
        torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 1, dtype=torch.bool), group_size=2
    )
    out = ADVANTAGE_ESTIMATORS["reinforce++"](x, AdvantageConfig(gamma=1.0))
    expected = torch.tensor([[-0.5], [-1.16667], [0.83333], [0.83333]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.returns, torch.tensor([[1.0], [0.0], [3.0], [3.0]]))


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # groups (1, 0), (3, 3) -> centred 0.5, -0.5, 0, 0; mean 0; unbiased std = sqrt(0.5 / 3) = 0.40825
    # A = 1.22474, -1.22474, 0, 0
    x = AdvantageInputs(
        torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 1, dtype=torch.bool), group_size=2
    )
    out = ADVANTAGE_ESTIMATORS["reinforce++-baseline"](x, AdvantageConfig(gamma=1.0))
    expected = torch.tensor([[1.22474], [-1.22474], [0.0], [0.0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "reinforce++", "reinforce++-baseline", "gae"]
)
def test_every_estimator_zeroes_masked_positions(name):
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(4, 5, generator=g) < 0.6
    mask[1] = False
    x = AdvantageInputs(
        torch.randn(4, generator=g), mask, group_size=2, values=torch.randn(4, 5, generator=g)
    )
    out = ADVANTAGE_ESTIMATORS[name](x, AdvantageConfig())
    assert (out.advantages[~mask] == 0).all() and (out.returns[~mask] == 0).all()
    assert torch.isfinite(out.advantages).all()
