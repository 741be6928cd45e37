"""Loss aggregation modes: hand-worked numbers, masking, gradients, reference loop."""

import pytest
import torch

from rollflash.algos.aggregation import AGG_MODES, aggregate

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor(
    [[True, True, False], [True, False, False], [False, False, False]]
)  # row 2 all-masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        # selected: row0 {1, 2}, row1 {4}, row2 {} -> (1 + 2 + 4) / 3 tokens = 2.3333
        ("token-mean", 7.0 / 3.0),
        # row means 1.5, 4.0; row2 has no token and is skipped -> (1.5 + 4.0) / 2 = 2.75
        ("seq-mean-token-mean", 2.75),
        # row sums 3, 4 -> (3 + 4) / 2 = 3.5
        ("seq-mean-token-sum", 3.5),
    ],
)
def test_hand_worked(mode, expected):
    torch.testing.assert_close(aggregate(VALUES, MASK, mode), torch.tensor(expected))


def test_dr_grpo_norm_len():
    # row sums 3, 4 divided by the constant 4 -> (0.75 + 1.0) / 2 = 0.875
    out = aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=4)
    torch.testing.assert_close(out, torch.tensor(0.875))


def test_norm_len_required():
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm")


def test_unknown_mode_lists_known():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(VALUES, MASK, "token-avg")


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_masked_positions_holding_inf_and_nan_change_nothing(mode):
    poisoned = VALUES.clone()
    poisoned[0, 2] = float("-inf")
    poisoned[2, 0] = float("nan")
    poisoned.requires_grad_(True)
    out = aggregate(poisoned, MASK, mode, norm_len=4)
    torch.testing.assert_close(out, aggregate(VALUES, MASK, mode, norm_len=4))
    out.backward()
    assert torch.isfinite(poisoned.grad).all()
    assert (poisoned.grad[~MASK] == 0).all()


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_all_masked_batch_is_zero_with_zero_grad(mode):
    values = torch.full((2, 3), float("-inf"), requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3, dtype=torch.bool), mode, norm_len=4)
    out.backward()
    assert out.item() == 0.0
    torch.testing.assert_close(values.grad, torch.zeros(2, 3))


def test_token_mean_analytic_gradient():
    # d/dv_ij (sum_selected v / 3) = 1/3 on the 3 selected tokens, 0 elsewhere
    values = VALUES.clone().requires_grad_(True)
    aggregate(values, MASK, "token-mean").backward()
    torch.testing.assert_close(values.grad, MASK.float() / 3.0)


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_gradcheck(mode):
    values = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda v: aggregate(v, mask, mode, norm_len=5), (values,))


def _reference(values, mask, mode, norm_len):
    rows = []
    all_tokens = []
    for b in range(values.shape[0]):
        toks = [values[b, t].item() for t in range(values.shape[1]) if mask[b, t]]
        all_tokens += toks
        if not toks:
            continue
        if mode == "seq-mean-token-mean":
            rows.append(sum(toks) / len(toks))
        elif mode == "seq-mean-token-sum":
            rows.append(sum(toks))
        elif mode == "seq-mean-token-sum-norm":
            rows.append(sum(toks) / norm_len)
    if mode == "token-mean":
        return sum(all_tokens) / max(len(all_tokens), 1)
    return sum(rows) / max(len(rows), 1)


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_matches_reference_loop(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 9, generator=g)
    mask = torch.rand(6, 9, generator=g) < 0.6
    mask[3] = False
    expected = torch.tensor(_reference(values, mask, mode, 16), dtype=torch.float32)
    torch.testing.assert_close(aggregate(values, mask, mode, norm_len=16), expected)
