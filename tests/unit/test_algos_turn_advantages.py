"""Multi-turn advantages (algos/turn_advantages.py and the "gigpo" estimator), with hand-worked numbers."""

import math
import random

import torch

from rollflash.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageInputs, TurnInputs
from rollflash.algos.turn_advantages import step_group_advantages, turn_returns, turns_to_tokens

S = 0.7071068  # 1 / sqrt(2)


def test_turn_returns_discount_per_turn_and_skip_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: R2 = 1; R1 = 0 + 0.5 * 1 = 0.5; R0 = 0 + 0.5 * 0.5 = 0.25
    # row 1: the padding turn's 9.0 is ignored: R1 = 2; R0 = 0.5 + 0.5 * 2 = 1.5
    torch.testing.assert_close(
        turn_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0], [1.5, 2.0, 0.0]])
    )


def test_step_groups_pool_identical_states_of_one_group_only():
    returns = torch.tensor([[0.5, 1.0], [0.0, 0.0], [3.0, 0.0], [1.0, 0.0]])
    states = torch.tensor([[7, 8], [7, 9], [7, 8], [7, 9]])  # group 1 reuses group 0's keys
    mask = torch.tensor([[True, True], [True, True], [True, False], [True, False]])
    out = step_group_advantages(returns, states, mask, group_size=2)
    # group 0, state 7: {0.5, 0}: mean 0.25, unbiased std sqrt(2 * 0.25^2 / 1) = 0.3536 -> +-0.7071
    # group 0, states 8 and 9: one turn each -> 0
    # group 1, state 7: {3, 1}: mean 2, std 1.4142 -> +-0.7071 (not pooled with group 0's state 7)
    expected = torch.tensor([[S, 0.0], [-S, 0.0], [S, 0.0], [-S, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def _slow_step_advantages(returns, states, mask, n, eps=1e-6):
    out = torch.zeros_like(returns)
    B, K = returns.shape
    for b in range(B):
        for k in range(K):
            if not mask[b, k]:
                continue
            g = b // n
            peers = [
                float(returns[i, j])
                for i in range(g * n, g * n + n)
                for j in range(K)
                if mask[i, j] and states[i, j] == states[b, k]
            ]
            if len(peers) < 2:
                continue
            mean = sum(peers) / len(peers)
            std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
            out[b, k] = (float(returns[b, k]) - mean) / (std + eps)
    return out


def test_step_groups_match_a_slow_reference_loop():
    rng = random.Random(0)
    B, K, n = 12, 5, 4
    returns = torch.tensor([[rng.uniform(-1, 2) for _ in range(K)] for _ in range(B)])
    states = torch.tensor([[rng.randrange(4) for _ in range(K)] for _ in range(B)])
    mask = torch.tensor([[k < rng.randint(1, K) for k in range(K)] for _ in range(B)])
    torch.testing.assert_close(
        step_group_advantages(returns, states, mask, n),
        _slow_step_advantages(returns, states, mask, n),
        atol=1e-5,
        rtol=0,
    )


def _two_episodes() -> AdvantageInputs:
    # response tokens: turn-0 action (2 tokens), an observation token, turn-1 action, padding
    token_turn = torch.tensor([[0, 0, -1, 1, -1], [0, 0, -1, 1, -1]])
    mask = token_turn >= 0
    turns = TurnInputs(
        token_turn=token_turn,
        rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
        mask=torch.ones(2, 2, dtype=torch.bool),
        state_ids=torch.tensor([[11, 12], [11, 13]]),
    )
    return AdvantageInputs(scores=torch.tensor([1.0, 0.0]), mask=mask, group_size=2, turns=turns)


def test_gigpo_adds_episode_and_step_advantages():
    out = ADVANTAGE_ESTIMATORS["gigpo"](_two_episodes(), AdvantageConfig(gamma=0.5))
    # episode level (GRPO): scores {1, 0}: mean 0.5, std 0.7071 -> A^E = +-0.7071
    # returns: ep0 R0 = 0 + 0.5 * 1 = 0.5, R1 = 1; ep1 R0 = R1 = 0
    # step groups: state 11 = {0.5, 0} -> +-0.7071; states 12, 13 alone -> 0
    # ep0: turn 0 = 0.7071 + 0.7071 = 1.4142, turn 1 = 0.7071; ep1: -1.4142, -0.7071
    expected = torch.tensor([[2 * S, 2 * S, 0.0, S, 0.0], [-2 * S, -2 * S, 0.0, -S, 0.0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)


def test_gigpo_step_weight_zero_is_trajectory_grpo():
    x = _two_episodes()
    gigpo = ADVANTAGE_ESTIMATORS["gigpo"](x, AdvantageConfig(gamma=0.5, step_weight=0.0))
    grpo = ADVANTAGE_ESTIMATORS["grpo"](x, AdvantageConfig())
    torch.testing.assert_close(gigpo.advantages, grpo.advantages)
    # trajectory-level GRPO: the same advantage on every action token, 0 on the observation
    assert grpo.advantages[0, 2] == 0 and grpo.advantages[0, 0] == grpo.advantages[0, 3]


def test_gigpo_on_single_turn_samples_is_scaled_grpo():
    x = _two_episodes()
    x.turns = None
    # one turn from the shared prompt state: the step group is the whole group, A^S = A^E
    gigpo = ADVANTAGE_ESTIMATORS["gigpo"](x, AdvantageConfig(gamma=0.5))
    grpo = ADVANTAGE_ESTIMATORS["grpo"](x, AdvantageConfig())
    torch.testing.assert_close(gigpo.advantages, 2 * grpo.advantages)


def test_turns_to_tokens_leaves_masked_positions_zero():
    per_turn = torch.tensor([[2.0, 3.0]])
    token_turn = torch.tensor([[0, -1, 1, 1]])
    mask = torch.tensor([[True, True, True, False]])  # the last action token is masked (filtered)
    torch.testing.assert_close(
        turns_to_tokens(per_turn, token_turn, mask), torch.tensor([[2.0, 0.0, 3.0, 0.0]])
    )
