"""The learner's update on a real tiny model: every policy loss and advantage estimator runs through
`train_step`, micro-batching keeps the loss exact, and the KL / entropy / critic wiring computes
what docs/algorithms.md says (hand-worked numbers in the comments)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash import algos
from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.step import logprobs
from rollflash.learner.step.critic import Critic
from rollflash.learner.step.logprobs import logprobs_from_logits, token_logprobs
from rollflash.learner.step.prepare import build_algo_models, prepare_batch
from rollflash.learner.step.step_spec import StepSpec
from rollflash.learner.step.train import policy_update, train_step


def _cfg(model_dir, algo=None, n=4, micro=64, **trainer):
    return config_from_dict(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"num_return_sequences": n, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": micro, **trainer},
            "algo": algo or {},
        }
    )


def _groups(model, tok, spec, behav_shift=0.0):
    """spec: one list per group of (answer text, reward, finished). Behaviour log-probs are the
    model's own (so the first update is on-policy) plus `behav_shift` on every token."""
    out = []
    for g, samples in enumerate(spec):
        prompt = tok(f"{g + 11}+{g + 3}=")["input_ids"]
        built = []
        for text, reward, finished in samples:
            resp = tok(text)["input_ids"][1:] + ([tok.eos_token_id] if finished else [])
            ids = torch.tensor([prompt + resp])
            with torch.no_grad():
                logp, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
            behav = logp[0, len(prompt) - 1 :].numpy() + behav_shift
            built.append(
                Sample(
                    np.array(resp, "<i4"),
                    behav.astype("<f4"),
                    np.zeros(len(resp), "<i4"),
                    reward=reward,
                    finished=finished,
                    text=text,
                )
            )
        out.append(
            Trajectory(f"t{g}", f"p{g}", f"g{g}", "gen-0", 0, 0, np.array(prompt, "<i4"), built)
        )
    return out


MIXED = [
    [("14", 1.0, True), ("15", 0.1, True), ("9", 0.0, True), ("145", 0.1, False)],
    [("16", 0.1, True), ("18", 1.0, True), ("1", 0.0, True), ("18", 1.0, True)],
    [("20", 0.0, True), ("2", 0.1, True), ("20", 0.0, True), ("2000", 0.0, False)],
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir)


def _fresh(model_dir, lr=1e-3):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _changed(before: dict, module: torch.nn.Module) -> int:
    return sum(not torch.equal(before[k], v) for k, v in module.state_dict().items())


# what a loss needs beside it (broker/config/config_rules.py): GSPO is a sequence-level objective
LOSS_NEEDS = {"gspo": {"loss_agg_mode": "seq-mean-token-mean", "is_level": "geometric"}}
COMBOS = (
    [{"policy_loss": p, **LOSS_NEEDS.get(p, {})} for p in algos.POLICY_LOSSES]
    + [
        {"adv_estimator": e, "critic": e in algos.CRITIC_ESTIMATORS, "clip_range_value": 0.2}
        for e in algos.ADVANTAGE_ESTIMATORS
    ]
    + [
        {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg_mode": "seq-mean-token-sum-norm"},
        {"kl_coef": 0.1, "use_kl_in_reward": True, "kl_estimator": "k1", "reward_norm": "running"},
        {"is_mode": "mask", "is_low": 0.5, "is_level": "geometric", "reward_norm": "batch"},
        {
            "dynamic_sampling": True,
            "overlong_filter": True,
            "overlong_buffer": 2,
            "clip_high": 0.28,
            "reward_clip": 0.5,
        },
    ]
)


@pytest.mark.parametrize("algo", COMBOS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_train_step_updates_the_policy_with_finite_metrics(tiny, algo):
    model_dir, tok = tiny
    cfg = _cfg(model_dir, algo, micro=5)
    model, opt = _fresh(model_dir)
    models = build_algo_models(cfg)
    groups = _groups(model, tok, MIXED, behav_shift=0.05)
    before = copy.deepcopy(model.state_dict())
    critic_before = copy.deepcopy(models.critic.state_dict()) if models.critic else None
    metrics = train_step(model, opt, groups, cfg, models)
    assert _changed(before, model) > 0
    assert metrics["optim/skipped"] == 0.0
    # at ratio 1, seq-mean-token-mean makes the loss -mean_i(A_i): exactly 0 for GRPO's
    # zero-mean advantages; the update moves the weights all the same (above)
    if cfg.algo.loss_agg_mode != "seq-mean-token-mean":
        assert metrics["loss/policy"] != 0.0
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad
    if cfg.algo.critic:
        assert _changed(critic_before, models.critic) > 0
        assert {"loss/value", "critic/value_mse", "critic/explained_var"} <= set(metrics)
    if cfg.algo.entropy_coef > 0:
        assert metrics["policy/entropy"] > 0
    if cfg.algo.kl_coef > 0 and not cfg.algo.use_kl_in_reward:
        # the reference is the initial policy, which the step starts from: KL(pi || ref) = 0 exactly
        assert metrics["kl/ref_kl"] == 0.0 and metrics["loss/kl"] == 0.0


def test_every_policy_loss_and_estimator_is_covered():
    covered_losses = {c.get("policy_loss", "ppo") for c in COMBOS}
    covered_estimators = {c.get("adv_estimator", "grpo") for c in COMBOS}
    assert covered_losses == set(algos.POLICY_LOSSES)
    assert covered_estimators == set(algos.ADVANTAGE_ESTIMATORS)


def test_kl_loss_grows_once_the_policy_leaves_the_reference(tiny):
    model_dir, tok = tiny
    cfg = _cfg(model_dir, {"kl_coef": 0.1})
    model, opt = _fresh(model_dir, lr=1e-2)
    models = build_algo_models(cfg)
    first = train_step(model, opt, _groups(model, tok, MIXED), cfg, models)
    second = train_step(model, opt, _groups(model, tok, MIXED), cfg, models)
    assert first["kl/ref_kl"] == 0.0
    assert second["kl/ref_kl"] > 1e-6  # k3 > 0 whenever the log-probs differ


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(tiny, agg):
    # SGD with lr 1 and no clipping: the parameter change is minus the gradient, so equal changes for
    # micro_batch_size 1 and 64 mean the accumulated gradient equals the full-batch gradient.
    # overlong_filter masks the truncated samples: empty rows must not count in the seq-mean shares.
    model_dir, tok = tiny
    algo = {"loss_agg_mode": agg, "kl_coef": 0.2, "entropy_coef": 0.05, "overlong_filter": True}
    deltas = []
    for micro in (1, 64):
        cfg = _cfg(model_dir, algo, micro=micro, max_grad_norm=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        models = build_algo_models(cfg)
        batch = prepare_batch(_groups(model, tok, MIXED, behav_shift=0.1), StepSpec.of(cfg), models)
        before = copy.deepcopy(model.state_dict())
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        policy_update(model, sgd, batch.micro_batches, StepSpec.of(cfg))
        deltas.append({k: v - before[k] for k, v in model.state_dict().items()})
    for name in deltas[0]:
        torch.testing.assert_close(deltas[0][name], deltas[1][name], atol=1e-6, rtol=1e-4)


def test_micro_batches_carry_each_sequences_own_group_advantage(tiny):
    # group 0 rewards [1, 0]: mean 0.5, unbiased std 0.7071 -> A = +-0.5 / 0.7071 = +-0.7071
    # group 1 rewards [0.5, 0.5]: A = 0. Length sorting must not mix the rows up.
    model_dir, tok = tiny
    cfg = _cfg(model_dir, n=2, micro=1)
    model, _ = _fresh(model_dir)
    groups = _groups(
        model,
        tok,
        [[("1234", 1.0, True), ("1", 0.0, True)], [("22", 0.5, True), ("333", 0.5, True)]],
    )
    batch = prepare_batch(groups, StepSpec.of(cfg), build_algo_models(cfg))
    expected = {(1, 2, 3, 4): 0.7071, (1,): -0.7071, (2, 2): 0.0, (3, 3, 3): 0.0}
    seen = set()
    for mb in batch.micro_batches:
        resp = mb.input_ids[0, 1:][mb.mask[0]].tolist()[:-1]  # response targets minus EOS
        answer = tuple(int(t) for t in tok.decode(resp))
        adv = mb.advantages[0][mb.mask[0]]
        torch.testing.assert_close(adv, torch.full_like(adv, expected[answer]), atol=1e-4, rtol=0)
        seen.add(answer)
    assert seen == set(expected)


def test_kl_in_reward_lowers_the_score_by_kl_coef_times_summed_kl(tiny):
    # behaviour = reference + 0.1 on every token, k1 = 0.1 per token, kl_coef 0.5:
    # "14"<eos> has 3 tokens -> score 1 - 0.5 * 0.3 = 0.85; "1"<eos> has 2 -> 1 - 0.5 * 0.2 = 0.90.
    # dr_grpo: A = score - mean = 0.85 - 0.875 = -0.025 and +0.025.
    model_dir, tok = tiny
    cfg = _cfg(
        model_dir,
        {
            "adv_estimator": "dr_grpo",
            "kl_coef": 0.5,
            "use_kl_in_reward": True,
            "kl_estimator": "k1",
        },
        n=2,
    )
    model, _ = _fresh(model_dir)
    groups = _groups(model, tok, [[("14", 1.0, True), ("1", 1.0, True)]], behav_shift=0.1)
    batch = prepare_batch(groups, StepSpec.of(cfg), build_algo_models(cfg))
    assert batch.metrics["kl/behav_ref_kl"] == pytest.approx(0.1, abs=1e-5)
    advs = sorted(
        float(mb.advantages[i][mb.mask[i]][0])
        for mb in batch.micro_batches
        for i in range(mb.input_ids.shape[0])
    )
    assert advs == pytest.approx([-0.025, 0.025], abs=1e-5)


def test_kl_in_reward_clamps_k3_at_10_per_token(tiny):
    # behaviour 15 nats below the reference on every token: k3 = e^15 - 1 - 15 = 3.3e6, clamped
    # to 10. "14"<eos> (3 tokens): 1 - 0.5 * 30 = -14; "1"<eos> (2): 1 - 0.5 * 20 = -9;
    # dr_grpo: A = score - mean(-11.5) = -2.5 and +2.5; every token clamped
    model_dir, tok = tiny
    algo = {"adv_estimator": "dr_grpo", "kl_coef": 0.5, "use_kl_in_reward": True}
    cfg = _cfg(model_dir, {**algo, "kl_estimator": "k3"}, n=2)
    model, _ = _fresh(model_dir)
    groups = _groups(model, tok, [[("14", 1.0, True), ("1", 1.0, True)]], behav_shift=-15.0)
    batch = prepare_batch(groups, StepSpec.of(cfg), build_algo_models(cfg))
    assert batch.metrics["kl/clamped_frac"] == 1.0
    assert batch.metrics["kl/behav_ref_kl"] == pytest.approx(10.0)
    advs = sorted(
        float(mb.advantages[i][mb.mask[i]][0])
        for mb in batch.micro_batches
        for i in range(mb.input_ids.shape[0])
    )
    assert advs == pytest.approx([-2.5, 2.5], abs=1e-4)


def test_all_groups_filtered_skips_the_update(tiny):
    model_dir, tok = tiny
    cfg = _cfg(model_dir, {"dynamic_sampling": True}, n=2)
    model, opt = _fresh(model_dir)
    before = copy.deepcopy(model.state_dict())
    metrics = train_step(
        model,
        opt,
        _groups(model, tok, [[("1", 1.0, True), ("2", 1.0, True)]]),
        cfg,
        build_algo_models(cfg),
    )
    assert metrics["optim/skipped"] == 1.0 and metrics["filter/dropped_in_step"] == 1.0
    assert _changed(before, model) == 0


def test_chunked_logprobs_and_entropy_equal_unchunked_with_gradients(monkeypatch):
    """Slices of 2 columns (chunk 6 positions over 3 rows) under checkpointing give the same
    values and the same gradients as one slice; no slice is ever the whole [b, L-1, V]."""
    monkeypatch.setattr(logprobs, "UNSLICED_BYTES", 0)  # slice however small the upcast
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 8))
    plain, plain_ent = logprobs_from_logits(logits, ids, 0.7, True, 0, torch.float64)
    chunked, chunked_ent = logprobs_from_logits(logits, ids, 0.7, True, 6, torch.float64)
    # by hand for one position: log softmax(z / 0.7)[y] of row 1, position 4 (predicting ids[1, 5])
    z = logits[1, 4].detach() / 0.7
    expected = z[ids[1, 5]] - torch.logsumexp(z, dim=0)
    torch.testing.assert_close(chunked[1, 4].double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(chunked_ent, plain_ent)
    (g_plain,) = torch.autograd.grad((plain * 2 + plain_ent).sum(), logits)
    (g_chunked,) = torch.autograd.grad((chunked * 2 + chunked_ent).sum(), logits)
    torch.testing.assert_close(g_chunked, g_plain)
    assert chunked.dtype == torch.float32  # always float32 for the ratio


def test_logprobs_are_sliced_only_when_the_upcast_is_large(monkeypatch):
    """Slicing saves memory at the price of a second pass: an upcast [b, L-1, V] of at most
    UNSLICED_BYTES is one slice (no checkpoint), a larger one is sliced by `chunk`."""
    slices = []

    def counting(fn, *args, **kwargs):
        slices.append(args[0].shape[1])  # the slice's columns
        return fn(*args)

    monkeypatch.setattr(logprobs, "checkpoint", counting)
    logits, ids = torch.randn(4, 9, 5), torch.randint(0, 5, (4, 9))
    # upcast: 4 rows x 8 positions x 5 tokens x 4 bytes = 640 bytes
    monkeypatch.setattr(logprobs, "UNSLICED_BYTES", 640)
    logprobs_from_logits(logits, ids, 1.0, chunk=8)
    assert slices == []  # 640 <= 640: one slice, kept for the backward pass
    monkeypatch.setattr(logprobs, "UNSLICED_BYTES", 639)
    logprobs_from_logits(logits, ids, 1.0, chunk=8)
    assert slices == [2, 2, 2, 2]  # chunk 8 positions over 4 rows = 2 columns per slice


def test_bf16_logprob_dtype_returns_float32_close_to_float32(monkeypatch):
    monkeypatch.setattr(logprobs, "UNSLICED_BYTES", 0)
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 50) * 3
    ids = torch.randint(0, 50, (2, 6))
    exact, _ = logprobs_from_logits(logits, ids, 1.0, chunk=4)
    low, _ = logprobs_from_logits(logits, ids, 1.0, chunk=4, dtype=torch.bfloat16)
    assert low.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: |z| <= ~12 is rounded by up to 12 * 2^-8 = 0.047
    torch.testing.assert_close(low, exact, atol=0.1, rtol=0)
    assert not torch.equal(low, exact)


def test_critic_value_at_t_sees_only_tokens_up_to_t(tiny_model_dir):
    critic = Critic.load(tiny_model_dir, "float32")
    torch.nn.init.normal_(critic.value_head.weight)  # the zero init would make any check pass
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[0, 4] = 12
    with torch.no_grad():
        v, v2 = critic(ids, torch.ones_like(ids)), critic(changed, torch.ones_like(ids))
    assert v.shape == (1, 5)  # [b, L-1]: position t is V(tokens 0..t)
    torch.testing.assert_close(v[0, :4], v2[0, :4])  # positions 0..3 do not see token 4
    assert not torch.allclose(v[0, 4], v2[0, 4])
