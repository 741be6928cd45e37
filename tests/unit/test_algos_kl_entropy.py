"""KL estimators k1/k2/k3 (k3 clamped at 10 in value and gradient, as verl's low_var_kl), the KL
loss, the direction of the k3 metrics, token entropy from logits and the entropy bonus."""

import math

import pytest
import torch

from rollflash.algos.entropy import entropy_bonus, entropy_from_logits
from rollflash.algos.kl import KL_ESTIMATORS, approx_kl, kl_loss, kl_penalty
from rollflash.algos.rewards import kl_reward_penalty

T_, F_ = True, False


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", 0.5),  # log pi - log ref = -1.0 - (-1.5) = 0.5
        ("k2", 0.125),  # 0.5^2 / 2
        (
            "k3",
            0.10653,
        ),  # r = ref / pi = e^-0.5 = 0.60653; (r - 1) - log r = -0.39347 + 0.5 = 0.10653
    ],
)
def test_hand_worked(kind, expected):
    out = kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), kind)
    torch.testing.assert_close(out, torch.tensor([[expected]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_average_to_exact_kl(kind):
    # exact expectation over a 4-token vocabulary: sum_y pi(y) k(y) = KL(pi || ref) for k1 and k3
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = (pi * (pi / ref).log()).sum()  # = 0.10644 nats
    per_token = kl_penalty(pi.log().unsqueeze(0), ref.log().unsqueeze(0), kind)
    torch.testing.assert_close((pi * per_token[0]).sum(), exact)
    torch.testing.assert_close(exact, torch.tensor(0.10644, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(KL_ESTIMATORS))
def test_mask_zeroes_inf_positions_without_nan_grad(kind):
    logp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.tensor([[T_, F_]])
    out = kl_penalty(logp, ref, kind, mask=mask)
    assert out[0, 1].item() == 0.0
    out.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


def test_k2_loss_gradient_is_log_ratio():
    # d/dlogp_t of mean_t 0.5 (logp_t - ref_t)^2 = (logp_t - ref_t) / N: 0.5 / 2, -0.25 / 2
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = kl_loss(logp, torch.tensor([[-1.5, -1.75]]), torch.ones(1, 2, dtype=torch.bool), "k2")
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.25, -0.125]]))
    # value: (0.125 + 0.03125) / 2 = 0.078125
    torch.testing.assert_close(out.metrics["kl/ref_kl"], torch.tensor(0.078125))


def test_kl_loss_gradcheck():
    g = torch.Generator().manual_seed(13)
    logp = -torch.rand(2, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[T_, T_, F_, F_], [T_, T_, T_, T_]])
    for kind in KL_ESTIMATORS:
        assert torch.autograd.gradcheck(
            lambda lp, kind=kind: kl_loss(lp, ref, mask, kind).loss, (logp,)
        )


def test_unknown_kind_lists_known():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_entropy_hand_worked():
    # uniform over 4 -> log 4 = 1.38629; two finite logits and two banned (-inf) -> log 2 = 0.69315
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, float("-inf"), 0.0, float("-inf")]]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([[1.38629, 0.69315]]), atol=1e-5, rtol=0
    )


def test_entropy_matches_reference_loop_and_upcasts_bf16():
    g = torch.Generator().manual_seed(14)
    logits = 3 * torch.randn(2, 3, 7, generator=g)
    expected = torch.zeros(2, 3)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            z = math.log(sum(math.exp(v) for v in row))
            expected[b, t] = -sum(math.exp(v - z) * (v - z) for v in row)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_entropy_gradcheck():
    logits = torch.randn(2, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


def test_entropy_bonus_sign_and_mask():
    # selected entropies 1.0, 2.0 (t2 masked, NaN) -> mean 1.5; the bonus loss is -1.5
    ent = torch.tensor([[1.0, 2.0, float("nan")]], requires_grad=True)
    out = entropy_bonus(ent, torch.tensor([[T_, T_, F_]]))
    torch.testing.assert_close(out.loss, torch.tensor(-1.5))
    torch.testing.assert_close(out.metrics["policy/entropy"], torch.tensor(1.5))
    out.loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.5, -0.5, 0.0]]))


def test_k3_is_clamped_at_log_ratio_minus_15_in_value_and_gradient():
    # token 0: log pi - log ref = -16 - (-1) = -15 -> k3 = e^15 - 1 - 15 = 3269001.4, clamped to 10,
    #   and its gradient is 0 (the clamp holds it: the token stops pulling)
    # token 1: log ratio -1 -> k3 = e^1 - 1 - 1 = 0.71828, d k3 / d logp = 1 - e^1 = -1.71828
    # token-mean over both: loss = (10 + 0.71828) / 2 = 5.35914; grads [0, -1.71828 / 2 = -0.85914]
    logp = torch.tensor([[-16.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])
    out = kl_loss(logp, ref, torch.ones(1, 2, dtype=torch.bool), "k3")
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(5.35914), atol=1e-5, rtol=0)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.85914]]), atol=1e-5, rtol=0)
    assert out.metrics["kl/clamped_frac"] == 0.5  # one token of two
    # the raw k3 the clamp removes: a single token would otherwise weigh 3.3e6
    assert math.exp(15) - 16 > 3.2e6
    # at +15 the other side: k3 = e^-15 - 1 + 15 = 14.0 -> 10 as well
    up = kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[-16.0]]), "k3")
    torch.testing.assert_close(up, torch.tensor([[10.0]]))


def test_k3_reward_penalty_is_clamped_too():
    # behaviour 15 nats below the reference on one token: -kl_coef * min(k3, 10) = -0.1 * 10 = -1.0
    out = kl_reward_penalty(
        torch.tensor([[-16.0]]),
        torch.tensor([[-1.0]]),
        torch.ones(1, 1, dtype=torch.bool),
        0.1,
        "k3",
    )
    torch.testing.assert_close(out, torch.tensor([[-1.0]]))


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_only_k3_is_clamped(kind):
    # k1 = -15, k2 = 112.5: never clamped, and kl/clamped_frac stays 0
    out = kl_loss(
        torch.tensor([[-16.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), kind
    )
    assert out.metrics["kl/clamped_frac"] == 0.0
    assert abs(out.loss.item()) == pytest.approx({"k1": 15.0, "k2": 112.5}[kind])


def test_approx_kl_direction_hand_worked():
    # the sampler drew the token with log p = -1; the other policy gives it log q = -2.
    # KL(sampler || other) per token: d = log q - log p = -1, e^d - 1 - d = 0.36788 - 1 + 1 = 0.36788
    # (the reversed form e^-d - 1 + d = e - 2 = 0.71828 is what a swapped call would give)
    got = approx_kl(
        torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.ones(1, 1, dtype=torch.bool)
    )
    torch.testing.assert_close(got, torch.tensor(0.36788), atol=1e-5, rtol=0)
