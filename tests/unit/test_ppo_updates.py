"""PPO mini-batches and epochs (`trainer.ppo_mini_batches` M, `trainer.ppo_epochs` E) in
`train_step`: the proximal policy is the policy at the start of the step, so the first update's
ratio is 1 and later updates' ratios move, and the clip bounds bind exactly at 1 - clip_low and
1 + clip_high (hand-worked on a two-token model); M = E = 1 is the one-update step bit for bit;
the critic's value clip binds with E = 2."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.step.batch import mini_batch_rows
from rollflash.learner.step.losses import LossSpec, policy_loss
from rollflash.learner.step.prepare import build_algo_models, prepare_batch
from rollflash.learner.step.step_spec import StepSpec
from rollflash.learner.step.train import loss_shares, train_step
from tests.unit.test_learner_train import MIXED, _groups


class TwoTokenLM(torch.nn.Module):
    """Logits w [2] at every position, whatever the input: p(token 0) = sigmoid(w0 - w1)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.w.expand(*input_ids.shape, 2))


def _group(g: int, w: torch.Tensor) -> Trajectory:
    """Two one-token answers to a one-token prompt: token 0 (reward 1) and token 1 (reward 0),
    behaviour log-probs from `w`."""
    logp = torch.log_softmax(w.detach(), -1)
    samples = [
        Sample(
            np.array([tok], "<i4"),
            np.array([float(logp[tok])], "<f4"),
            np.zeros(1, "<i4"),
            reward=reward,
            finished=True,
        )
        for tok, reward in ((0, 1.0), (1, 0.0))
    ]
    return Trajectory(f"t{g}", f"p{g}", f"g{g}", "gen-0", 0, 0, np.array([0], "<i4"), samples)


def _toy_cfg(**trainer):
    return config_from_dict(
        {
            "rollout": {"num_return_sequences": 2, "max_new_tokens": 1},
            "trainer": {"rollout_batch_size": 2, "max_grad_norm": 0.0, **trainer},
            "algo": {
                "adv_estimator": "dr_grpo",
                "clip_low": 0.2,
                "clip_high": 0.28,
                "dual_clip_c": None,
                "tis_cap": None,
            },
        }
    )


def _two_updates(lr: float):
    model = TwoTokenLM()
    groups = [_group(0, model.w), _group(1, model.w)]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    stats = train_step(
        model, opt, groups, _toy_cfg(ppo_mini_batches=2), build_algo_models(_toy_cfg())
    )
    return model.w.detach(), stats


def test_mini_batches_deal_groups_round_robin_over_the_whole_step():
    # 4 groups of 2 on a rank whose first group is the step's group 1 (M = 2):
    # step groups 1, 3 -> mini-batch 1; 2, 4 -> mini-batch 0
    m0, m1 = mini_batch_rows(4, 2, 2, first_group=1)
    assert m0.tolist() == [2, 3, 6, 7] and m1.tolist() == [0, 1, 4, 5]
    assert [r.tolist() for r in mini_batch_rows(3, 2, 1)] == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize(
    "lr,clipped_low,clipped_high",
    [(0.80, False, False), (0.82, True, False), (1.14, True, False), (1.16, True, True)],
)
def test_second_mini_batch_clips_exactly_at_the_bounds(lr, clipped_low, clipped_high):
    # A = reward - group mean (dr_grpo): +0.5 for token 0, -0.5 for token 1; p = (0.5, 0.5).
    # update 1 (group 0; ratio 1): loss = -(0.5 r0 - 0.5 r1) / 2, dL/dw = [-0.25, 0.25],
    #   so w' = [0.25 lr, -0.25 lr] and p0' = sigmoid(0.5 lr)
    # update 2 (group 1, the same answers): r0 = p0' / 0.5 = 2 sigmoid(0.5 lr), r1 = 2 - r0
    #   token 1 (A < 0) clips below 1 - 0.2: r1 < 0.8 <=> lr > 2 ln(0.6 / 0.4) = 0.8109
    #   token 0 (A > 0) clips above 1 + 0.28: r0 > 1.28 <=> lr > 2 ln(0.64 / 0.36) = 1.1507
    #   lr 0.80: r1 = 0.8026, lr 0.82: r1 = 0.7978; lr 1.14: r0 = 1.2775, lr 1.16: r0 = 1.2821
    w, stats = _two_updates(lr)
    s = 1 / (1 + math.exp(-0.5 * lr))
    r0, r1 = 2 * s, 2 - 2 * s
    p0, p1 = s, 1 - s  # after update 1
    # update 2's gradient: each unclipped token contributes -A * r * (e_tok - p') / 2
    grad = torch.zeros(2)
    if not clipped_high:
        grad += -0.5 * r0 * torch.tensor([1 - p0, -p1]) / 2
    if not clipped_low:
        grad += 0.5 * r1 * torch.tensor([-p0, 1 - p1]) / 2
    expected = torch.tensor([0.25 * lr, -0.25 * lr]) - lr * grad
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    assert stats["optim/updates"] == 2.0
    # the metrics are means over the two updates; update 1 clips nothing (ratio exactly 1)
    assert stats["policy/clip_frac_low"] == pytest.approx(0.25 * clipped_low)
    assert stats["policy/clip_frac_high"] == pytest.approx(0.25 * clipped_high)
    assert stats["policy/ratio_max"] == pytest.approx(r0, abs=1e-6)  # update 2's token 0
    # approx_kl of update 2: k3 = (r - 1) - ln r per token, mean of both; update 1's is 0
    k3 = sum((r - 1) - math.log(r) for r in (r0, r1)) / 2
    assert stats["policy/approx_kl"] == pytest.approx(k3 / 2, rel=1e-4)


def test_one_update_step_skips_the_proximal_pass_and_never_clips():
    model = TwoTokenLM()
    groups = [_group(0, model.w), _group(1, model.w)]
    stats = train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=5.0),
        groups,
        _toy_cfg(),
        build_algo_models(_toy_cfg()),
    )
    assert stats["optim/updates"] == 1.0
    assert stats["policy/clip_frac"] == 0.0 and stats["policy/ratio_max"] == 1.0
    assert stats["policy/approx_kl"] == 0.0


def _reference_step(model, opt, groups, cfg, models) -> None:
    """The one-update step written out: prox = the detached log-probs of the update itself."""
    batch = prepare_batch(groups, StepSpec.of(cfg), models)
    opt.zero_grad(set_to_none=True)
    shares = loss_shares(batch.micro_batches, cfg.algo.loss_agg_mode)
    for mb, share in zip(batch.micro_batches, shares):
        assert mb.prox_logp is None
        loss, _ = policy_loss(model, mb, LossSpec.of(cfg))
        (loss * share).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.trainer.max_grad_norm)
    opt.step()


def test_one_mini_batch_one_epoch_is_the_one_update_step_bit_for_bit(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = config_from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 5, "rollout_batch_size": 3},
            "algo": {"kl_coef": 0.1, "entropy_coef": 0.01},
        }
    )
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = copy.deepcopy(a)
    groups = _groups(a, tok, MIXED, behav_shift=0.05)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (a, b))
    train_step(a, opt_a, groups, cfg, build_algo_models(cfg))
    _reference_step(b, opt_b, groups, cfg, build_algo_models(cfg))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_value_clip_binds_in_the_second_epoch(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(epochs: int) -> dict[str, float]:
        cfg = config_from_dict(
            {
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
                "trainer": {"micro_batch_size": 16, "rollout_batch_size": 3, "ppo_epochs": epochs},
                "algo": {
                    "adv_estimator": "gae",
                    "critic": True,
                    "critic_lr": 1e-3,
                    "clip_range_value": 1e-3,
                },
            }
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        models = build_algo_models(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return train_step(model, opt, _groups(model, tok, MIXED), cfg, models)

    one, two = run(1), run(2)
    # epoch 1 starts at the old values (V = V_old = 0, the zero head): nothing to clip. AdamW's
    # first step moves each of the head's weights by ~critic_lr towards the returns, so epoch 2's
    # values are past clip_range_value of the old ones and the clipped error is the larger.
    assert one["critic/vf_clip_frac"] == 0.0
    assert two["critic/vf_clip_frac"] > 0.0 and two["optim/updates"] == 2.0
