"""Decoupled PPO clip loss: hand-worked tokens, off-policy weights, masking, gradients, reference loop."""

import math

import pytest
import torch

from rollflash.algos.aggregation import AGG_MODES
from rollflash.algos.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    ppo_clip_loss,
)

NEG_INF = float("-inf")
LN3 = math.log(3.0)

# One response, 4 tokens, the last masked (padding with logp = -inf).
# log ratio logp - prox = 0.1, 0.3, 1.5 on the selected tokens; advantages +1, +1, -1.
PROX = torch.tensor([[-1.0, -1.0, -2.0, NEG_INF]])
LOGP = torch.tensor([[-0.9, -0.7, -0.5, NEG_INF]])
ADV = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
MASK = torch.tensor([[True, True, True, False]])


def _inputs(behav=PROX, logp=LOGP):
    return PolicyLossInputs(logp.clone().requires_grad_(True), PROX, behav, ADV, MASK)


def test_on_policy_hand_worked():
    # behav = prox -> w = 1
    # t0: r = e^0.1 = 1.10517 < 1.2 -> unclipped; loss = -1.10517 * 1
    # t1: r = e^0.3 = 1.34986 > 1.2 -> clipped;   loss = max(-1.34986, -1.2) = -1.2
    # t2: r = e^1.5 = 4.48169, A = -1 -> max(4.48169, 1.2) = 4.48169 > dual bound 3 -> 3
    # token-mean = (-1.10517 - 1.2 + 3) / 3 = 0.23161
    x = _inputs()
    out = ppo_clip_loss(x, PolicyLossConfig(clip_low=0.2, clip_high=0.2, dual_clip_c=3.0))
    torch.testing.assert_close(out.loss, torch.tensor(0.23161), atol=1e-4, rtol=0)
    m = out.metrics
    torch.testing.assert_close(m["policy/clip_frac"], torch.tensor(1 / 3))  # t1 only
    torch.testing.assert_close(m["policy/dual_clip_frac"], torch.tensor(1 / 3))  # t2 only
    # (1.10517 + 1.34986 + 4.48169) / 3 = 2.31224
    torch.testing.assert_close(m["policy/ratio_mean"], torch.tensor(2.31224), atol=1e-4, rtol=0)
    torch.testing.assert_close(m["policy/ratio_max"], torch.tensor(4.48169), atol=1e-4, rtol=0)
    # k3 = r - 1 - log r: 0.00517 + 0.04986 + 1.98169 = 2.03672 / 3 = 0.67891
    torch.testing.assert_close(m["policy/approx_kl"], torch.tensor(0.67891), atol=1e-4, rtol=0)
    torch.testing.assert_close(m["offpolicy/is_weight_mean"], torch.tensor(1.0))
    torch.testing.assert_close(m["offpolicy/is_trunc_frac"], torch.tensor(0.0))
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    # gradient: only t0 is unclipped: d/dlogp0 (-A e^(logp0 - prox0) / 3) = -1.10517 / 3 = -0.36839;
    # t1 clipped and t2 dual-clipped have zero gradient; t3 (masked, -inf) exactly 0, not NaN
    out.loss.backward()
    torch.testing.assert_close(
        x.logp.grad, torch.tensor([[-0.36839, 0.0, 0.0, 0.0]]), atol=1e-4, rtol=0
    )


def test_clip_higher_unclips_t1():
    # clip_high 0.28 (DAPO) -> bound 1.28 < 1.34986 still clipped: loss t1 = -1.28
    # t2 without dual clip: 4.48169. token-mean = (-1.10517 - 1.28 + 4.48169) / 3 = 0.69884
    out = ppo_clip_loss(_inputs(), PolicyLossConfig(clip_high=0.28, dual_clip_c=None))
    torch.testing.assert_close(out.loss, torch.tensor(0.69884), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.metrics["policy/dual_clip_frac"], torch.tensor(0.0))


def test_truncated_importance_weight():
    # prox - behav = ln3, 0, -0.5 -> w = min(3, 2) = 2, 1, e^-0.5 = 0.60653
    # loss = (2 * -1.10517 + 1 * -1.2 + 0.60653 * 3) / 3 = -1.59075 / 3 = -0.53025
    behav = torch.tensor([[-1.0 - LN3, -1.0, -1.5, NEG_INF]])
    x = _inputs(behav=behav)
    out = ppo_clip_loss(x, PolicyLossConfig(tis_cap=2.0))
    torch.testing.assert_close(out.loss, torch.tensor(-0.53025), atol=1e-4, rtol=0)
    m = out.metrics
    # applied w mean = (2 + 1 + 0.60653) / 3 = 1.20218; raw max = 3; 1 of 3 truncated
    torch.testing.assert_close(
        m["offpolicy/is_weight_mean"], torch.tensor(1.20218), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(m["offpolicy/is_weight_max"], torch.tensor(2.0))
    torch.testing.assert_close(m["offpolicy/raw_is_weight_max"], torch.tensor(3.0))
    torch.testing.assert_close(m["offpolicy/is_trunc_frac"], torch.tensor(1 / 3))
    # gradient t0 = w * (-1.10517) / 3 = -0.73678
    out.loss.backward()
    torch.testing.assert_close(
        x.logp.grad, torch.tensor([[-0.73678, 0.0, 0.0, 0.0]]), atol=1e-4, rtol=0
    )


def test_no_correction_when_tis_cap_none():
    behav = torch.tensor([[-1.0 - LN3, -1.0, -1.5, NEG_INF]])
    out = ppo_clip_loss(_inputs(behav=behav), PolicyLossConfig(tis_cap=None))
    torch.testing.assert_close(out.loss, torch.tensor(0.23161), atol=1e-4, rtol=0)  # as on-policy


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_all_masked_batch_gives_zero_loss_and_zero_grad(name):
    logp = torch.full((2, 3), NEG_INF, requires_grad=True)
    nan = torch.full((2, 3), float("nan"))
    x = PolicyLossInputs(logp, nan, nan, nan, torch.zeros(2, 3, dtype=torch.bool))
    out = POLICY_LOSSES[name](x, PolicyLossConfig())
    out.loss.backward()
    assert out.loss.item() == 0.0
    torch.testing.assert_close(logp.grad, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_all_masked_row_changes_nothing(name):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(2, 5, generator=g)
    prox = logp + 0.1 * torch.randn(2, 5, generator=g)
    behav = prox + 0.1 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    for mode in AGG_MODES:
        cfg = PolicyLossConfig(agg_mode=mode, norm_len=8)
        alone = POLICY_LOSSES[name](PolicyLossInputs(logp, prox, behav, adv, mask), cfg)
        # extra row of garbage, fully masked
        pad = lambda t, v: torch.cat([t, torch.full((1, 5), v)])  # noqa: E731
        padded = PolicyLossInputs(
            pad(logp, NEG_INF),
            pad(prox, float("nan")),
            pad(behav, NEG_INF),
            pad(adv, 1e9),
            torch.cat([mask, torch.zeros(1, 5, dtype=torch.bool)]),
        )
        with_row = POLICY_LOSSES[name](padded, cfg)
        torch.testing.assert_close(with_row.loss, alone.loss)
        for k in alone.metrics:
            torch.testing.assert_close(with_row.metrics[k], alone.metrics[k])


def test_ppo_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    prox = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    logp = (prox + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    behav = prox + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) < 0.7
    cfg = PolicyLossConfig(dual_clip_c=1.5)
    fn = lambda lp: ppo_clip_loss(PolicyLossInputs(lp, prox, behav, adv, mask), cfg).loss  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,))


def _reference_ppo(logp, prox, behav, adv, mask, cfg):
    """Slow scalar loop, token-mean."""
    total, count = 0.0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(logp[b, t] - prox[b, t])
            a = adv[b, t].item()
            clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            loss = max(-a * r, -a * clipped)
            if a < 0:
                loss = min(loss, -a * cfg.dual_clip_c)
            w = min(math.exp(prox[b, t] - behav[b, t]), cfg.tis_cap)
            total += w * loss
            count += 1
    return total / count


def test_ppo_matches_reference_loop():
    g = torch.Generator().manual_seed(5)
    prox = -torch.rand(4, 7, generator=g)
    logp = prox + 0.4 * torch.randn(4, 7, generator=g)
    behav = prox + 0.6 * torch.randn(4, 7, generator=g)
    adv = torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) < 0.7
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=2.0, tis_cap=1.5)
    out = ppo_clip_loss(PolicyLossInputs(logp, prox, behav, adv, mask), cfg)
    expected = _reference_ppo(logp, prox, behav, adv, mask, cfg)
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=torch.float32))


def test_shape_mismatch_is_an_error():
    x = PolicyLossInputs(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.zeros(2, 4),
        torch.ones(2, 3, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="shape"):
        ppo_clip_loss(x, PolicyLossConfig())
