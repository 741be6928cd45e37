"""Off-policy importance weights: truncate / mask modes, token / sequence / geometric levels."""

import math

import pytest
import torch

from rollflash.algos.offpolicy import IS_LEVELS, IS_MODES, importance_weights
from rollflash.algos.policy_loss import PolicyLossConfig, PolicyLossInputs, ppo_clip_loss

T_, F_ = True, False
LN3, LN4 = math.log(3.0), math.log(4.0)


def test_mask_mode_drops_tokens_outside_interval():
    # prox - behav = ln3, 0, -ln4 -> w = 3 (> 2: dropped), 1 (kept), 0.25 (< 0.5: dropped)
    behav = torch.tensor([[-LN3, 0.0, LN4]])
    out = importance_weights(
        torch.zeros(1, 3), behav, torch.ones(1, 3, dtype=torch.bool), mode="mask", cap=2.0, low=0.5
    )
    torch.testing.assert_close(out.weight, torch.tensor([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(out.metrics["offpolicy/is_trunc_frac"], torch.tensor(2 / 3))
    # raw mean = (3 + 1 + 0.25) / 3 = 1.41667
    torch.testing.assert_close(
        out.metrics["offpolicy/raw_is_weight_mean"], torch.tensor(1.41667), atol=1e-4, rtol=0
    )


def test_mask_mode_keeps_weight_inside_interval():
    # prox - behav = -0.5 -> w = e^-0.5 = 0.60653 in [0.5, 2] -> kept as 0.60653 (IcePop keeps the ratio)
    out = importance_weights(
        torch.tensor([[-1.0]]),
        torch.tensor([[-0.5]]),
        torch.ones(1, 1, dtype=torch.bool),
        mode="mask",
        cap=2.0,
        low=0.5,
    )
    torch.testing.assert_close(out.weight, torch.tensor([[0.60653]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "level, expected",
    [
        # token: e^0.1 = 1.10517, e^0.2 = 1.22140
        ("token", [1.10517, 1.22140]),
        # sequence: e^(0.1 + 0.2) = e^0.3 = 1.34986 on both tokens
        ("sequence", [1.34986, 1.34986]),
        # geometric: e^((0.1 + 0.2) / 2) = e^0.15 = 1.16183
        ("geometric", [1.16183, 1.16183]),
    ],
)
def test_levels(level, expected):
    prox = torch.tensor([[0.1, 0.2, 5.0]])  # t2 masked: its ratio e^5 must not enter the sequence
    mask = torch.tensor([[T_, T_, F_]])
    out = importance_weights(prox, torch.zeros(1, 3), mask, level=level, cap=2.0)
    torch.testing.assert_close(out.weight, torch.tensor([expected + [0.0]]), atol=1e-5, rtol=0)


def test_sequence_level_truncates_product():
    # 0.5 + 0.5 -> e^1 = 2.71828 > cap 2 -> 2 on every token, both counted truncated
    out = importance_weights(
        torch.tensor([[0.5, 0.5]]),
        torch.zeros(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
        level="sequence",
        cap=2.0,
    )
    torch.testing.assert_close(out.weight, torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(out.metrics["offpolicy/is_trunc_frac"], torch.tensor(1.0))


@pytest.mark.parametrize("mode", list(IS_MODES))
@pytest.mark.parametrize("level", list(IS_LEVELS))
def test_on_policy_weights_are_one_and_masked_are_zero(mode, level):
    logp = torch.tensor([[-0.3, -1.2, float("-inf")]])
    mask = torch.tensor([[T_, T_, F_]])
    out = importance_weights(logp, logp, mask, mode=mode, level=level, cap=2.0, low=0.5)
    torch.testing.assert_close(out.weight, torch.tensor([[1.0, 1.0, 0.0]]))
    assert all(torch.isfinite(v) for v in out.metrics.values())
    torch.testing.assert_close(out.metrics["offpolicy/approx_kl"], torch.tensor(0.0))


def test_weights_carry_no_gradient():
    prox = torch.zeros(1, 2, requires_grad=True)
    out = importance_weights(prox, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert not out.weight.requires_grad


def test_unknown_names_list_known():
    m = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="truncate"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), m, mode="clip")
    with pytest.raises(ValueError, match="geometric"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), m, level="seq")


def test_ppo_with_mask_mode_end_to_end():
    # the PPO example of test_algos_policy: token losses -1.10517, -1.2, 3 (dual-clipped)
    # prox - behav = ln3, 0, -0.5 -> mask [0.5, 2]: w = 0 (dropped), 1, 0.60653
    # loss = (0 - 1.2 + 0.60653 * 3) / 3 = 0.61959 / 3 = 0.20653
    prox = torch.tensor([[-1.0, -1.0, -2.0]])
    logp = torch.tensor([[-0.9, -0.7, -0.5]])
    behav = torch.tensor([[-1.0 - LN3, -1.0, -1.5]])
    x = PolicyLossInputs(
        logp, prox, behav, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    )
    out = ppo_clip_loss(x, PolicyLossConfig(is_mode="mask", tis_cap=2.0, is_low=0.5))
    torch.testing.assert_close(out.loss, torch.tensor(0.20653), atol=1e-4, rtol=0)


def test_matches_reference_loop():
    g = torch.Generator().manual_seed(12)
    prox = torch.randn(4, 6, generator=g)
    behav = prox + 0.5 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.7
    for level in IS_LEVELS:
        out = importance_weights(prox, behav, mask, mode="truncate", level=level, cap=1.3)
        expected = torch.zeros(4, 6)
        for b in range(4):
            diffs = [(prox[b, t] - behav[b, t]).item() for t in range(6) if mask[b, t]]
            for t in range(6):
                if not mask[b, t]:
                    continue
                log_w = {
                    "token": (prox[b, t] - behav[b, t]).item(),
                    "sequence": sum(diffs),
                    "geometric": sum(diffs) / len(diffs),
                }[level]
                expected[b, t] = min(math.exp(log_w), 1.3)
        torch.testing.assert_close(out.weight, expected)
