"""Reward clipping / normalisation / KL-in-reward, and DAPO filtering and overlong penalty."""

import dataclasses

import pytest
import torch

from rollflash.algos.dapo import (
    dynamic_sampling_mask,
    overlong_filter_mask,
    soft_overlong_penalty,
)
from rollflash.algos.rewards import (
    REWARD_NORMS,
    RunningRewardNorm,
    clip_rewards,
    kl_reward_penalty,
    normalize_rewards,
)

T_, F_ = True, False


def test_clip_rewards():
    scores = torch.tensor([-3.0, 0.5, 7.0])
    torch.testing.assert_close(clip_rewards(scores, 1.0), torch.tensor([-1.0, 0.5, 1.0]))
    torch.testing.assert_close(clip_rewards(scores, None), scores)


def test_batch_norm_hand_worked():
    # mean 1; deviations 0, -1, 2, -1; unbiased var = 6 / 3 = 2 -> std 1.41421
    out = normalize_rewards(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), "batch")
    expected = torch.tensor([[0.0, -0.70711], [1.41421, -0.70711]])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def test_group_norm_hand_worked():
    # group (1, 0): mean 0.5, std 0.70711 -> +-0.70711; group (3, 3): 0
    out = normalize_rewards(torch.tensor([[1.0, 0.0], [3.0, 3.0]]), "group")
    torch.testing.assert_close(
        out, torch.tensor([[0.70711, -0.70711], [0.0, 0.0]]), atol=1e-4, rtol=0
    )


def test_running_norm_matches_statistics_of_everything_seen():
    # after (1, 2, 3) and (4, 5): mean 3, unbiased var of 1..5 = 10 / 4 = 2.5 -> std 1.58114
    state = RunningRewardNorm()
    normalize_rewards(torch.tensor([[1.0, 2.0, 3.0]]), "running", running=state)
    out = normalize_rewards(torch.tensor([[4.0, 5.0]]), "running", running=state)
    assert (
        state.count == 5
        and state.mean == pytest.approx(3.0)
        and state.std == pytest.approx(1.58114, abs=1e-5)
    )
    # (4 - 3) / 1.58114 = 0.63246; (5 - 3) / 1.58114 = 1.26491
    torch.testing.assert_close(out, torch.tensor([[0.63246, 1.26491]]), atol=1e-4, rtol=0)
    restored = RunningRewardNorm(**dataclasses.asdict(state))
    assert restored == state


def test_running_norm_matches_reference_over_many_batches():
    g = torch.Generator().manual_seed(17)
    batches = [torch.randn(int(n), generator=g) * 3 + 1 for n in (5, 1, 9, 4)]
    state = RunningRewardNorm()
    for b in batches:
        state.update(b)
    everything = torch.cat(batches).double()
    assert state.mean == pytest.approx(everything.mean().item(), abs=1e-9)
    assert state.std == pytest.approx(everything.std().item(), abs=1e-9)


def test_running_norm_needs_state_and_unknown_mode_lists_known():
    with pytest.raises(ValueError, match="RunningRewardNorm"):
        normalize_rewards(torch.zeros(1, 2), "running")
    with pytest.raises(ValueError, match=", ".join(REWARD_NORMS)):
        normalize_rewards(torch.zeros(1, 2), "zscore")


def test_kl_reward_penalty_hand_worked():
    # k1: log pi - log ref = 0.5, 0 -> -0.1 * (0.5, 0) = (-0.05, 0); masked t2 (-inf) -> 0
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -3.0]])
    out = kl_reward_penalty(logp, ref, torch.tensor([[T_, T_, F_]]), kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0, 0.0]]))
    assert not out.requires_grad


def test_dynamic_sampling_mask():
    # all-correct, mixed, all-equal-0.5 -> keep only the mixed group
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    torch.testing.assert_close(dynamic_sampling_mask(rewards), torch.tensor([F_, T_, F_]))
    # spread 1e-3 <= atol 1e-2 counts as equal
    near = torch.tensor([[0.5, 0.501]])
    torch.testing.assert_close(dynamic_sampling_mask(near, atol=1e-2), torch.tensor([F_]))


def test_overlong_filter_mask():
    torch.testing.assert_close(overlong_filter_mask(torch.tensor([T_, F_])), torch.tensor([F_, T_]))


def test_soft_overlong_penalty_hand_worked():
    # max 100, buffer 20 -> expected length 80; exceed = L - 80 = -30, 0, 10, 20, 40
    # -exceed / 20 clamped to [-1, 0] -> 0, 0, -0.5, -1, -1
    lengths = torch.tensor([50, 80, 90, 100, 120])
    torch.testing.assert_close(
        soft_overlong_penalty(lengths, 100, 20), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0])
    )
    torch.testing.assert_close(
        soft_overlong_penalty(lengths, 100, 20, penalty_factor=0.5),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]),
    )
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(lengths, 100, 0)


def test_soft_overlong_penalty_matches_reference_loop():
    lengths = torch.arange(0, 130, 7)
    expected = []
    for L in lengths.tolist():
        if L <= 100 - 30:
            expected.append(0.0)
        elif L <= 100:
            expected.append(((100 - 30) - L) / 30)
        else:
            expected.append(-1.0)
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 30), torch.tensor(expected))
