"""Clipped value loss."""

import pytest
import torch

from rollflash.algos.value_loss import value_loss

T_, F_ = True, False
NAN = float("nan")
# t0: V 1.1, V_old 1.0, R 1.5: V - V_old = 0.1 inside 0.2 -> V_clip = V; (−0.4)^2 = 0.16 -> 0.08
# t1: V 2.0, V_old 1.5, R 1.0: V_clip = 1.7: errors 1.0 vs 0.49 -> unclipped 1.0 -> 0.5
# t2: V 1.5, V_old 3.0, R 1.0: V_clip = 2.8: errors 0.25 vs 3.24 -> clipped 3.24 -> 1.62
# t3: masked (NaN everywhere)
VALUES = torch.tensor([[1.1, 2.0, 1.5, NAN]])
OLD = torch.tensor([[1.0, 1.5, 3.0, NAN]])
RET = torch.tensor([[1.5, 1.0, 1.0, NAN]])
MASK = torch.tensor([[T_, T_, T_, F_]])


def test_clipped_hand_worked():
    v = VALUES.clone().requires_grad_(True)
    out = value_loss(v, OLD, RET, MASK, 0.2)
    # (0.08 + 0.5 + 1.62) / 3 = 0.73333
    torch.testing.assert_close(out.loss, torch.tensor(0.73333), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.metrics["critic/vf_clip_frac"], torch.tensor(1 / 3))
    out.loss.backward()
    # grad (V - R) / 3 on unclipped tokens: -0.4 / 3, 1.0 / 3; clipped t2 and masked t3: 0
    torch.testing.assert_close(
        v.grad, torch.tensor([[-0.13333, 0.33333, 0.0, 0.0]]), atol=1e-4, rtol=0
    )


def test_unclipped_hand_worked():
    # 0.5 * (0.16 + 1.0 + 0.25) / 3 = 0.235
    out = value_loss(VALUES, OLD, RET, MASK, None)
    torch.testing.assert_close(out.loss, torch.tensor(0.235))
    torch.testing.assert_close(out.metrics["critic/vf_clip_frac"], torch.tensor(0.0))


def test_all_masked_is_zero_and_finite():
    v = torch.full((2, 2), NAN, requires_grad=True)
    out = value_loss(v, v.detach(), v.detach(), torch.zeros(2, 2, dtype=torch.bool), 0.2)
    out.loss.backward()
    assert out.loss.item() == 0.0
    torch.testing.assert_close(v.grad, torch.zeros(2, 2))
    assert all(torch.isfinite(m) for m in out.metrics.values())


def test_gradcheck():
    g = torch.Generator().manual_seed(15)
    v = torch.randn(2, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    old = v.detach() + 0.5 * torch.randn(2, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 5, generator=g) < 0.7
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, ret, mask, 0.2).loss, (v,))


@pytest.mark.parametrize("clip", [None, 0.3])
def test_matches_reference_loop(clip):
    g = torch.Generator().manual_seed(16)
    v = torch.randn(3, 6, generator=g)
    old = v + 0.5 * torch.randn(3, 6, generator=g)
    ret = torch.randn(3, 6, generator=g)
    mask = torch.rand(3, 6, generator=g) < 0.7
    total, n = 0.0, 0
    for b in range(3):
        for t in range(6):
            if mask[b, t]:
                vv, oo, rr = v[b, t].item(), old[b, t].item(), ret[b, t].item()
                err = (vv - rr) ** 2
                if clip is not None:
                    vc = oo + min(max(vv - oo, -clip), clip)
                    err = max(err, (vc - rr) ** 2)
                total += 0.5 * err
                n += 1
    out = value_loss(v, old, ret, mask, clip)
    torch.testing.assert_close(out.loss, torch.tensor(total / n))
    # explained variance = 1 - Var(R - V) / Var(R) over selected tokens
    sel_r, sel_v = ret[mask], v[mask]
    expected_ev = 1 - (sel_r - sel_v).var() / sel_r.var()
    torch.testing.assert_close(out.metrics["critic/explained_var"], expected_ev)
