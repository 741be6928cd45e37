"""GSPO, CISPO, TOPR and REINFORCE: hand-worked numbers, gradients, reference loops."""

import math

import pytest
import torch

from rollflash.algos.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    cispo_loss,
    gspo_loss,
    reinforce_loss,
    topr_loss,
)

T_, F_ = True, False


def _x(diff, adv, mask, prox_value=-1.0):
    """prox = prox_value everywhere, logp = prox + diff, behav = prox (w = 1)."""
    prox = torch.full_like(diff, prox_value)
    logp = (prox + diff).requires_grad_(True)
    return PolicyLossInputs(logp, prox, prox, adv, mask)


def test_gspo_hand_worked():
    # row0: log ratios 0.1, 0.3 (t2 masked) -> mean 0.2 -> s = e^0.2 = 1.22140 < 1.3 -> unclipped, A = +1
    #   per token loss -1.22140; row mean -1.22140
    # row1: log ratios -0.5, -0.1, 0.0 -> mean -0.2 -> s = e^-0.2 = 0.81873 > 0.8 -> unclipped, A = -1
    #   per token loss +0.81873
    # seq-mean-token-mean = (-1.22140 + 0.81873) / 2 = -0.20134
    diff = torch.tensor([[0.1, 0.3, 0.0], [-0.5, -0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[T_, T_, F_], [T_, T_, T_]])
    x = _x(diff, adv, mask)
    cfg = PolicyLossConfig(
        clip_low=0.2, clip_high=0.3, dual_clip_c=None, agg_mode="seq-mean-token-mean"
    )
    out = gspo_loss(x, cfg)
    torch.testing.assert_close(out.loss, torch.tensor(-0.20134), atol=1e-4, rtol=0)
    # grad: d s / d logp_t = s / |y_i|; row0: 1/2 * -1 * 1.22140 / 2 = -0.30535
    #       row1: 1/2 * +1 * 0.81873 / 3 = 0.13646
    out.loss.backward()
    expected = torch.tensor([[-0.30535, -0.30535, 0.0], [0.13646, 0.13646, 0.13646]])
    torch.testing.assert_close(x.logp.grad, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.metrics["policy/clip_frac"], torch.tensor(0.0))


def test_gspo_clips_whole_sequence():
    # mean log ratio 0.2 -> s = 1.22140 > 1 + 0.2 -> every token clipped: loss -1.2, zero gradient
    x = _x(torch.tensor([[0.1, 0.3]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[T_, T_]]))
    out = gspo_loss(x, PolicyLossConfig(clip_high=0.2, agg_mode="seq-mean-token-mean"))
    torch.testing.assert_close(out.loss, torch.tensor(-1.2))
    out.loss.backward()
    torch.testing.assert_close(x.logp.grad, torch.zeros(1, 2))
    torch.testing.assert_close(out.metrics["policy/clip_frac"], torch.tensor(1.0))


def test_gspo_matches_sequence_level_reference():
    # GSPO as written in the paper (one ratio per sequence, loss per sequence, mean over sequences)
    g = torch.Generator().manual_seed(8)
    prox = -torch.rand(5, 6, generator=g, dtype=torch.float64)
    diff = 0.2 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64).expand(5, 6).contiguous()
    mask = torch.rand(5, 6, generator=g) < 0.7
    mask[:, 0] = True
    cfg = PolicyLossConfig(
        clip_low=0.1, clip_high=0.15, dual_clip_c=None, agg_mode="seq-mean-token-mean"
    )
    logp = (prox + diff).requires_grad_(True)
    out = gspo_loss(PolicyLossInputs(logp, prox, prox, adv, mask), cfg)
    (grad,) = torch.autograd.grad(out.loss, logp)

    ref_logp = (prox + diff).requires_grad_(True)
    losses = []
    for b in range(5):
        sel = mask[b]
        s = torch.exp((ref_logp[b][sel] - prox[b][sel]).mean())
        a = adv[b, 0]
        losses.append(torch.maximum(-a * s, -a * s.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)))
    ref = torch.stack(losses).mean()
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_cispo_hand_worked():
    # prox -1; logp -0.9, -0.5 -> r = e^0.1 = 1.10517 (kept), e^0.5 = 1.64872 -> 1 + 0.28 = 1.28
    # loss_t = -sg(w) * A * logp: -1.10517 * -0.9 = 0.99465; -1.28 * -0.5 = 0.64 -> mean 0.81733
    x = _x(torch.tensor([[0.1, 0.5]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[T_, T_]]))
    out = cispo_loss(x, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    torch.testing.assert_close(out.loss, torch.tensor(0.81733), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.metrics["policy/clip_frac"], torch.tensor(0.5))
    # grad = -w * A / 2: the clipped token still has a gradient (the point of CISPO)
    out.loss.backward()
    torch.testing.assert_close(x.logp.grad, torch.tensor([[-0.55259, -0.64]]), atol=1e-4, rtol=0)


def test_topr_hand_worked():
    # prox -1 everywhere. row0 A = +1, diffs 0.5, 0.5 -> coef 1 (no ratio for positive A)
    # row1 A = -1, diffs 0.2, -0.9 -> seq ratio e^-0.7 = 0.49659 -> coef 0.49659
    # row2 A = -1, diffs 0.3, 0.4 -> seq ratio e^0.7 = 2.01375 -> truncated to 1
    # loss_t = -coef * A * logp:
    #   row0: -(-0.5) * 2 = 0.5 + 0.5 = 1.0
    #   row1: -0.49659 * (-1) * (-0.8) = -0.39727; * (-1.9) -> -0.94352
    #   row2: -(-1) * (-0.7) = -0.7; -0.6
    #   total = 1.0 - 1.34079 - 1.3 = -1.64079 / 6 tokens = -0.27347
    diff = torch.tensor([[0.5, 0.5], [0.2, -0.9], [0.3, 0.4]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    x = _x(diff, adv, torch.ones(3, 2, dtype=torch.bool))
    out = topr_loss(x, PolicyLossConfig())
    torch.testing.assert_close(out.loss, torch.tensor(-0.27347), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        out.metrics["policy/clip_frac"], torch.tensor(1 / 3)
    )  # row2's tokens
    # grad = -coef * A / 6
    out.loss.backward()
    expected = torch.tensor([[-1 / 6, -1 / 6], [0.08277, 0.08277], [1 / 6, 1 / 6]])
    torch.testing.assert_close(x.logp.grad, expected, atol=1e-4, rtol=0)


def test_reinforce_hand_worked():
    # logp -0.5, -2.0 (prox -1: diffs 0.5, -1.0); A = +1, -1 -> loss = (0.5 + -2.0) / 2 = -0.75
    x = _x(torch.tensor([[0.5, -1.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[T_, T_]]))
    out = reinforce_loss(x, PolicyLossConfig())
    torch.testing.assert_close(out.loss, torch.tensor(-0.75))
    out.loss.backward()
    torch.testing.assert_close(x.logp.grad, torch.tensor([[-0.5, 0.5]]))  # -A / 2


def _reference_token_loss(name, lp, px, a, cfg, seq_log_ratio):
    r = math.exp(lp - px)
    if name == "cispo":
        return -min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) * a * lp
    if name == "topr":
        coef = 1.0 if a >= 0 else min(1.0, math.exp(seq_log_ratio))
        return -coef * a * lp
    return -a * lp  # reinforce


@pytest.mark.parametrize("name", ["cispo", "topr", "reinforce"])
def test_matches_reference_loop(name):
    g = torch.Generator().manual_seed(9)
    prox = -torch.rand(4, 6, generator=g) - 0.1
    logp = prox + 0.3 * torch.randn(4, 6, generator=g)
    behav = prox + 0.5 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.7
    cfg = PolicyLossConfig(clip_low=0.5, clip_high=0.3, tis_cap=1.5)
    out = POLICY_LOSSES[name](PolicyLossInputs(logp, prox, behav, adv, mask), cfg)
    total, count = 0.0, 0
    for b in range(4):
        seq = sum((logp[b, t] - prox[b, t]).item() for t in range(6) if mask[b, t])
        for t in range(6):
            if mask[b, t]:
                w = min(math.exp(prox[b, t] - behav[b, t]), cfg.tis_cap)
                lp, px, a = logp[b, t].item(), prox[b, t].item(), adv[b, t].item()
                total += w * _reference_token_loss(name, lp, px, a, cfg, seq)
                count += 1
    torch.testing.assert_close(out.loss, torch.tensor(total / count))


@pytest.mark.parametrize("name", ["gspo", "reinforce"])
def test_gradcheck_float64(name):
    # Only losses whose gradient is the derivative of their value: REINFORCE, and GSPO-token when the
    # advantage and the off-policy weight are constant per sequence (then equal to sequence-level GSPO,
    # which has no stop-gradient); is_level "sequence" makes the weight per-sequence.
    g = torch.Generator().manual_seed(10)
    prox = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp = (prox + 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    behav = prox + 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).contiguous()
    mask = torch.rand(3, 5, generator=g) < 0.7
    mask[:, 0] = True
    cfg = PolicyLossConfig(
        clip_low=0.5, clip_high=0.5, agg_mode="seq-mean-token-mean", is_level="sequence"
    )
    fn = lambda lp: POLICY_LOSSES[name](PolicyLossInputs(lp, prox, behav, adv, mask), cfg).loss  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,))


@pytest.mark.parametrize("name", ["cispo", "topr"])
def test_stop_gradient_losses_match_analytic_gradient(name):
    # CISPO and TOPR stop the gradient through their weights, so gradcheck (finite differences of the
    # value) does not apply; their intended gradient is d loss / d logp_t = -w_is * coef_t * A_t / N.
    g = torch.Generator().manual_seed(11)
    prox = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    logp = (prox + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    behav = prox + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) < 0.7
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, tis_cap=1.5)
    out = POLICY_LOSSES[name](PolicyLossInputs(logp, prox, behav, adv, mask), cfg)
    out.loss.backward()
    n = int(mask.sum())
    expected = torch.zeros(4, 6, dtype=torch.float64)
    for b in range(4):
        seq = sum((logp[b, t] - prox[b, t]).item() for t in range(6) if mask[b, t])
        for t in range(6):
            if not mask[b, t]:
                continue
            r = math.exp((logp[b, t] - prox[b, t]).item())
            a = adv[b, t].item()
            if name == "cispo":
                coef = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            else:
                coef = 1.0 if a >= 0 else min(1.0, math.exp(seq))
            w = min(math.exp(prox[b, t] - behav[b, t]), cfg.tis_cap)
            expected[b, t] = -w * coef * a / n
    torch.testing.assert_close(logp.grad, expected)
