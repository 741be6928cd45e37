"""Our shared conventions against a frozen table of verl's own numbers, checked on every run.

The table VERL was computed once by running verl's functions, at volcengine/verl commit
b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29), on the fixed float64 inputs below:
`verl/trainer/ppo/core_algos.py` `agg_loss`, `compute_policy_loss_vanilla` (clip_ratio_low 0.2,
clip_ratio_high 0.28, clip_ratio_c 3.0), `kl_penalty` ("k1", "k2", "low_var_kl") and
`compute_grpo_outcome_advantage` (epsilon 1e-6, with and without the std), and
`verl/trainer/ppo/rollout_corr_helper.py` `compute_rollout_correction_weights` (truncated IS at
2.0, token and sequence level) passed to the policy loss as `rollout_is_weights`. Each function
was taken from verl's source by name and run as written, with verl's `masked_sum` and
`masked_mean` from `verl/utils/torch_functional.py`; the one stub was the IS-weight metrics
helper, whose output the table does not use. Gradients are d loss / d log_prob, row-major;
numbers are rounded to 12 significant digits. No verl code is in this repository.

Tolerance 1e-7: verl adds 1e-8 to the denominator of a masked mean and of each row's token
mean, which moves its numbers by up to 3e-9 from the exact ones we compute. Departure, checked
as such: verl's "seq-mean-token-sum-norm" divides the sum over all rows by the constant; ours
also averages over the non-empty rows (Dr.GRPO's 1/G), so ours x 3 rows is verl's.
"""

import pytest
import torch

from rollflash.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    PolicyLossConfig,
    PolicyLossInputs,
    aggregate,
    kl_penalty,
    ppo_clip_loss,
)

D = torch.float64
# 4 rows x 4 tokens; row 3 is all masked. old = proximal, new = current, rollout = behaviour
OLD = torch.tensor(
    [[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.5, -0.7, -2.5], [-1.1, -0.9, -0.4, -3.0], [-1.0] * 4],
    dtype=D,
)
NEW = torch.tensor(
    [[-0.8, -0.9, -1.6, -1.2], [-0.6, -1.0, -0.7, -1.2], [-1.5, -0.2, -0.45, -2.0], [-0.5] * 4],
    dtype=D,
)
ROLLOUT = torch.tensor(
    [[-1.3, -0.4, -2.0, -1.0], [-0.3, -2.5, -0.2, -2.4], [-1.0, -0.9, -0.1, -3.0], [-1.0] * 4],
    dtype=D,
)
ADV = torch.tensor(
    [[1.0, 1.0, -0.5, 0.3], [-1.0, -1.0, 0.8, -2.0], [0.5, -0.7, 1.2, 1.2], [1.0] * 4], dtype=D
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
LOSS_MAT = torch.tensor(
    [[0.5, -1.0, 2.0, 9.0], [1.5, 0.25, -0.75, 3.0], [-2.0, 4.0, 9.0, 9.0], [9.0] * 4], dtype=D
)
NORM_LEN = 8.0  # verl's loss_scale_factor
# KL: log pi and log ref per token; the 3rd to 5th are far apart (k3 clamps at 10, the log
# ratio at +-20)
LOGP = torch.tensor([[-1.0, -2.0, -16.0, -0.5, -30.0, -1.0]], dtype=D)
REF = torch.tensor([[-1.5, -1.0, -1.0, -15.5, -1.0, -1.0]], dtype=D)
# GRPO: 2 groups of 4 responses, the outcome reward on each response's last token
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1], dtype=D)
RESPONSE_MASK = torch.tensor(
    [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]],
    dtype=torch.bool,
)

# fmt: off
VERL = {
    "agg_loss/token-mean": 0.833333333333,
    "agg_loss/seq-mean-token-mean": 0.833333330278,
    "agg_loss/seq-mean-token-sum": 2.5,
    "agg_loss/seq-mean-token-sum-norm": 0.9375,
    "ppo/token-mean/loss": 0.841930854171,
    "ppo/token-mean/grad": [
        -0.135711417573, -0.074480005115, 0.082879149869, 0.0,
        0.0, 0.1831912523, -0.088888888889, 0.0,
        -0.037240002558, 0.156625210581, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ],
    "ppo/token-mean/clip_frac": 0.111111110988,
    "ppo/token-mean/dual_clip_frac": 0.111111110988,
    "ppo/seq-mean-token-mean/loss": 0.689158976376,
    "ppo/seq-mean-token-mean/grad": [
        -0.135711417121, -0.074480004867, 0.082879149593, 0.0,
        0.0, 0.137393438882, -0.0666666665, 0.0,
        -0.055860003557, 0.234937814697, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ],
    "ppo/seq-mean-token-mean/clip_frac": 0.111111110988,
    "ppo/seq-mean-token-mean/dual_clip_frac": 0.111111110988,
    "ppo_tis/token/loss": 0.959807167292,
    "ppo_tis/token/grad": [
        -0.1831912523, -0.067392295524, 0.082879149869, 0.0,
        0.0, 0.3663825046, -0.053913836419, 0.0,
        -0.033696147762, 0.156625210581, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ],
    "ppo_tis/sequence/loss": 1.22036367521,
    "ppo_tis/sequence/grad": [
        -0.165758299738, -0.090970083675, 0.101228822244, 0.0,
        0.0, 0.273289234573, -0.13260663979, 0.0,
        -0.033696147762, 0.141720351141, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ],
    "kl/k1/value": [0.5, -1.0, -15.0, 15.0, -29.0, 0.0],
    "kl/k1/grad": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "kl/k2/value": [0.125, 0.5, 112.5, 112.5, 420.5, 0.0],
    "kl/k2/grad": [0.5, -1.0, -15.0, 15.0, -29.0, 0.0],
    "kl/k3/value": [0.106530659713, 0.718281828459, 10.0, 10.0, 10.0, 0.0],
    "kl/k3/grad": [0.393469340287, -1.71828182846, 0.0, 0.0, 0.0, 0.0],
    "adv/grpo": [
        0.866023903787, 0.866023903787, 0.0,
        -0.866023903787, 0.0, 0.0,
        -0.866023903787, -0.866023903787, -0.866023903787,
        0.866023903787, 0.866023903787, 0.0,
        0.208681922449, 0.0, 0.0,
        -0.626045767346, -0.626045767346, -0.626045767346,
        1.32165217551, 1.32165217551, 0.0,
        -0.90428833061, -0.90428833061, -0.90428833061,
    ],
    "adv/dr_grpo": [
        0.5, 0.5, 0.0,
        -0.5, 0.0, 0.0,
        -0.5, -0.5, -0.5,
        0.5, 0.5, 0.0,
        0.075, 0.0, 0.0,
        -0.225, -0.225, -0.225,
        0.475, 0.475, 0.0,
        -0.325, -0.325, -0.325,
    ],
}
# fmt: on

TOL = 1e-7


def _close(got, expected) -> None:
    torch.testing.assert_close(
        torch.as_tensor(got, dtype=D).flatten(),
        torch.tensor(expected, dtype=D).flatten(),
        atol=TOL,
        rtol=0,
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_modes(mode):
    _close(aggregate(LOSS_MAT, MASK, mode), VERL[f"agg_loss/{mode}"])


def test_dr_grpo_norm_mode_keeps_the_mean_over_rows():
    ours = aggregate(LOSS_MAT, MASK, "seq-mean-token-sum-norm", norm_len=NORM_LEN)
    # row sums 1.5, 4.0, 2.0: verl (1.5 + 4.0 + 2.0) / 8 = 0.9375; ours averages over the 3 rows
    _close(ours * 3, VERL["agg_loss/seq-mean-token-sum-norm"])


def _ppo(agg_mode: str, behav: torch.Tensor, **cfg):
    logp = NEW.clone().requires_grad_(True)
    out = ppo_clip_loss(
        PolicyLossInputs(logp, OLD, behav, ADV, MASK),
        PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg_mode=agg_mode, **cfg),
    )
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_clip_loss_with_dual_clip(mode):
    out, grad = _ppo(mode, OLD, tis_cap=None)  # behaviour = proximal: no off-policy weight
    _close(out.loss, VERL[f"ppo/{mode}/loss"])
    _close(grad, VERL[f"ppo/{mode}/grad"])
    _close(out.metrics["policy/clip_frac"], VERL[f"ppo/{mode}/clip_frac"])
    _close(out.metrics["policy/dual_clip_frac"], VERL[f"ppo/{mode}/dual_clip_frac"])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ppo_with_truncated_importance_weights(level):
    out, grad = _ppo("token-mean", ROLLOUT, tis_cap=2.0, is_mode="truncate", is_level=level)
    _close(out.loss, VERL[f"ppo_tis/{level}/loss"])
    _close(grad, VERL[f"ppo_tis/{level}/grad"])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_value_and_gradient(kind):
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, kind)
    value.sum().backward()
    _close(value, VERL[f"kl/{kind}/value"])
    _close(logp.grad, VERL[f"kl/{kind}/grad"])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_grpo_advantages(estimator):
    inputs = AdvantageInputs(scores=REWARDS, mask=RESPONSE_MASK, group_size=4)
    out = ADVANTAGE_ESTIMATORS[estimator](inputs, AdvantageConfig(eps=1e-6))
    _close(out.advantages, VERL[f"adv/{estimator}"])
