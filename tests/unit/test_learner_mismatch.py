"""`mismatch/*` (learner/step/losses.py `mismatch_metrics`): the learner's log-probs against the
generator's, of tokens the generator sampled. `mismatch/kl` estimates KL(behaviour || learner)."""

import torch

from rollflash.learner.step.losses import mismatch_metrics


def test_mismatch_kl_estimates_the_exact_kl_of_a_50_way_categorical():
    # behaviour p = softmax(z), learner q = softmax(z + noise) over 50 tokens (float64, seed 0):
    # exact KL(p || q) = sum_y p(y) log(p(y) / q(y)) = 0.3625; the k3 estimate from y ~ p has a
    # per-token std of 0.348, so over 200000 tokens its standard error is 0.348 / sqrt(2e5) =
    # 0.00078 (0.2%) and 2% is ~9 of them. The reversed k3 (e^-d - 1 + d) reads 0.79 here.
    g = torch.Generator().manual_seed(0)
    z = torch.randn(50, generator=g, dtype=torch.float64)
    behav = torch.log_softmax(z, 0)
    learner = torch.log_softmax(z + torch.randn(50, generator=g, dtype=torch.float64), 0)
    exact = float((behav.exp() * (behav - learner)).sum())
    assert abs(exact - 0.3625) < 1e-4
    y = torch.multinomial(behav.exp(), 200_000, replacement=True, generator=g)
    mask = torch.ones(1, len(y), dtype=torch.bool)
    m = mismatch_metrics(learner[y].float()[None], behav[y].float()[None], mask)
    assert abs(float(m["mismatch/kl"]) - exact) <= 0.02 * exact


def test_mismatch_metrics_hand_worked_and_masked():
    # d = learner - behaviour = [+0.5, -1.0] on the selected tokens, the third is padding (-inf)
    # abs_dlogp_mean = (0.5 + 1.0) / 2 = 0.75; ratio_max = e^0.5 = 1.64872
    # kl: e^d - 1 - d = [1.64872 - 1.5, 0.36788 - 1 + 1] = [0.14872, 0.36788] -> mean 0.25830
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]])
    behav = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    m = mismatch_metrics(logp, behav, mask)
    torch.testing.assert_close(m["mismatch/abs_dlogp_mean"], torch.tensor(0.75))
    torch.testing.assert_close(m["mismatch/ratio_max"], torch.tensor(1.64872), atol=1e-5, rtol=0)
    torch.testing.assert_close(m["mismatch/kl"], torch.tensor(0.25830), atol=1e-5, rtol=0)
    empty = mismatch_metrics(logp, behav, torch.zeros_like(mask))
    assert all(float(v) == 0.0 for v in empty.values())
