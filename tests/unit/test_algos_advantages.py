"""Outcome advantage estimators (GRPO, Dr.GRPO, RLOO) and the estimator registry."""

import math

import pytest
import torch

from rollflash.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    grpo_advantages,
    rloo_advantages,
)


def test_grpo_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.86603
    # group 1: all equal -> 0 / (0 + eps) = 0
    expected = torch.tensor([[0.86603, -0.86603, -0.86603, 0.86603], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(grpo_advantages(rewards), expected, atol=1e-4, rtol=0)


def test_dr_grpo_is_mean_only():
    # group mean 0.5 -> r - 0.5, no division
    out = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale=False)
    torch.testing.assert_close(out, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_grpo_single_sample_group_is_zero():
    torch.testing.assert_close(grpo_advantages(torch.tensor([[3.0], [1.0]])), torch.zeros(2, 1))


def test_grpo_matches_reference_loop():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(5, 8, generator=g)
    expected = torch.zeros(5, 8)
    for gi in range(5):
        row = rewards[gi].tolist()
        mean = sum(row) / 8
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / 7)
        for j in range(8):
            expected[gi, j] = (row[j] - mean) / (std + 1e-6)
    torch.testing.assert_close(grpo_advantages(rewards, eps=1e-6), expected)


def test_rloo_hand_worked():
    # A_0 = 1 - (0 + 0 + 1) / 3 = 0.66667; A_1 = 0 - (1 + 0 + 1) / 3 = -0.66667
    out = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(out, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))


def test_rloo_matches_reference_loop():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(3, 5, generator=g)
    expected = torch.zeros(3, 5)
    for gi in range(3):
        for i in range(5):
            others = [rewards[gi, j].item() for j in range(5) if j != i]
            expected[gi, i] = rewards[gi, i].item() - sum(others) / 4
    torch.testing.assert_close(rloo_advantages(rewards), expected)


def test_registry_broadcasts_to_tokens_and_zeroes_masked():
    # 1 group of 2: scores 1, 0 -> GRPO mean 0.5, std sqrt(0.5) = 0.70711 -> +-0.70711
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = ADVANTAGE_ESTIMATORS["grpo"](
        AdvantageInputs(scores, mask, group_size=2), AdvantageConfig()
    )
    expected = torch.tensor([[0.70711, 0.70711, 0.0], [-0.70711, 0.0, 0.0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.returns, out.advantages)


def test_registry_adds_dense_token_rewards_to_outcome_scores():
    # scores 1, 0 plus summed token rewards (-0.5 on row 0) -> totals 0.5, 0 -> Dr.GRPO: +-0.25
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[True, True], [True, True]])
    dense = torch.tensor([[-0.25, -0.25], [0.0, 0.0]])
    x = AdvantageInputs(scores, mask, group_size=2, token_rewards=dense)
    out = ADVANTAGE_ESTIMATORS["dr_grpo"](x, AdvantageConfig())
    torch.testing.assert_close(out.advantages, torch.tensor([[0.25, 0.25], [-0.25, -0.25]]))


def test_registry_rejects_ragged_groups():
    x = AdvantageInputs(torch.zeros(3), torch.ones(3, 2, dtype=torch.bool), group_size=2)
    with pytest.raises(ValueError, match="groups of 2"):
        ADVANTAGE_ESTIMATORS["rloo"](x, AdvantageConfig())
