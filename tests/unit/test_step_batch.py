"""The step's batch (learner/step/batch.py, learner/step/prepare.py): built once from return values and
frozen, copied to the device once, and never brought back to the host whole; further forward
inputs ride along in `model_inputs` to the one log-prob function without the losses reading them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.step.batch import MicroBatch, Sequences, StepBatch
from rollflash.learner.step.logprobs import LogprobSpec
from rollflash.learner.step.losses import LossSpec, policy_loss
from rollflash.learner.step.prepare import build_algo_models, prepare_batch
from rollflash.learner.step.step_spec import StepSpec
from rollflash.learner.step.train import train_step
from tests.unit.test_learner_train import MIXED, _groups

# the reference (kl_coef), the critic (gae) and the proximal pass (two mini-batches) all run
ALL_PASSES = {"adv_estimator": "gae", "critic": True, "kl_coef": 0.1, "clip_range_value": 0.2}


def _cfg(model_dir):
    return config_from_dict(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 5, "rollout_batch_size": 3, "ppo_mini_batches": 2},
            "algo": ALL_PASSES,
        }
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    groups = _groups(model, AutoTokenizer.from_pretrained(tiny_model_dir), MIXED, behav_shift=0.05)
    return tiny_model_dir, model, groups


def test_step_batch_is_frozen_once_prepared(tiny):
    model_dir, model, groups = tiny
    cfg = _cfg(model_dir)
    prepared = prepare_batch(groups, StepSpec.of(cfg), build_algo_models(cfg), policy=model)
    step = prepared.step
    assert isinstance(step, StepBatch) and step.input_ids.shape[0] == 12  # 3 groups x 4
    for name in ("advantages", "returns", "ref_logp", "old_values", "prox_logp"):
        assert getattr(step, name) is not None, name  # every pass ran and made the batch
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(step, name, torch.zeros(1))
    with pytest.raises(TypeError):
        step.model_inputs["routing"] = torch.zeros(1)
    mb = prepared.micro_batches[0]
    assert isinstance(mb, MicroBatch) and not isinstance(mb, StepBatch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mb.advantages = torch.zeros(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.mini_batches = []
    # 12 rows in micro-batches of at most 5, two mini-batches of 2 groups' and 1 group's rows:
    # 8 rows -> 5 + 3, 4 rows -> 4
    assert [[mb.input_ids.shape[0] for mb in mini] for mini in prepared.mini_batches] == [
        [5, 3],
        [4],
    ]


class HostCopies:
    """Records every `.cpu()`, and every `.to(cpu)`, `.tolist()` or `.numpy()` of a 2-D tensor
    with the step's rows (micro-batches hold fewer): the ways a step's tensor reaches the host."""

    def __init__(self, monkeypatch, rows: int):
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        for name in ("cpu", "to", "tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._spy(name, getattr(torch.Tensor, name)))
        self.rows = rows

    def _spy(self, name, original):
        def spy(t, *args, **kwargs):
            whole = t.dim() == 2 and t.shape[0] == self.rows
            if name == "cpu" or (whole and name != "to") or (whole and _to_cpu(args, kwargs)):
                self.seen.append((name, tuple(t.shape)))
            return original(t, *args, **kwargs)

        return spy


def _to_cpu(args, kwargs) -> bool:
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def test_no_step_tensor_returns_to_the_host_between_the_passes_and_the_updates(tiny, monkeypatch):
    model_dir, model, groups = tiny
    cfg = _cfg(model_dir)
    models = build_algo_models(cfg)
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    copies = HostCopies(monkeypatch, rows=12)
    torch.zeros(12, 3).to("cpu")
    torch.zeros(2).cpu()
    assert copies.seen == [("to", (12, 3)), ("cpu", (2,))]  # the spy sees what it should
    copies.seen.clear()
    stats = train_step(trained, opt, groups, cfg, models)
    assert copies.seen == []
    # reference, old values and proximal log-probs were all computed, and both updates made
    assert stats["optim/updates"] == 2.0 and "kl/behav_ref_kl" in stats and "loss/value" in stats


def test_sequences_go_to_the_device_whole_with_their_model_inputs():
    cuda = torch.device("cuda", 0)
    fields = {n: mock.MagicMock(spec=torch.Tensor) for n in ("ids", "attn", "mask", "behav")}
    routing = mock.MagicMock(spec=torch.Tensor)
    seqs = Sequences(*fields.values(), model_inputs={"routing": routing})
    moved = seqs.to(cuda)
    for name, t in zip(("input_ids", "attention_mask", "mask", "behav_logp"), fields.values()):
        assert getattr(moved, name) is t.pin_memory.return_value.to.return_value, name
        t.pin_memory.return_value.to.assert_called_once_with(cuda, non_blocking=True)
    assert moved.model_inputs["routing"] is routing.pin_memory.return_value.to.return_value
    assert seqs.to(torch.device("cpu")) is seqs  # the host is the device: nothing to copy


class BiasedLM(torch.nn.Module):
    """Logits emb[token] + token_bias on token 0: a forward pass with a further per-token
    input. `config` as a Hugging Face model's, for learner/step/packing.py."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(5, 5, generator=torch.Generator().manual_seed(0)))
        self.config = SimpleNamespace(_attn_implementation="eager")

    def forward(
        self, input_ids, token_bias, attention_mask=None, position_ids=None, use_cache=False
    ):
        logits = self.emb[input_ids].clone()
        logits[..., 0] = logits[..., 0] + token_bias
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("packed", [False, True])
def test_model_inputs_ride_along_to_the_forward_pass_row_by_row(packed):
    # rows of lengths 4, 2, 3 (right-padded with 0); token_bias is 10 * row + position, so a
    # row that got another row's bias, or a shifted one, gets other log-probs
    ids = torch.tensor([[1, 2, 3, 4], [2, 1, 0, 0], [4, 3, 2, 0]])
    attn = (ids > 0).long()
    bias = (10 * torch.arange(3)[:, None] + torch.arange(4)[None, :]).float() * attn
    mask = attn[:, 1:].bool()
    seqs = Sequences(ids, attn, mask, torch.zeros(3, 3), model_inputs={"token_bias": bias})
    step = StepBatch.of(seqs, advantages=torch.ones(3, 3))
    rows = torch.tensor([2, 1])
    mb = step.micro_batch(rows)
    assert mb.input_ids.shape == (2, 3) and mb.model_inputs["token_bias"].shape == (2, 3)
    model = BiasedLM()
    with torch.no_grad():
        logp, _ = LogprobSpec(packed=packed)(model, mb)
    # the slow way: one row at a time, its own bias, log softmax, the next token's entry
    for i, r in enumerate(rows.tolist()):
        n = int(attn[r].sum())
        with torch.no_grad():
            z = model(ids[r : r + 1, :n], bias[r : r + 1, :n]).logits[0]
        expected = torch.log_softmax(z[:-1], -1).gather(-1, ids[r, 1:n, None])[:, 0]
        torch.testing.assert_close(logp[i, : n - 1], expected)
    # and the loss reads the micro-batch without knowing the input is there
    cfg = config_from_dict({"trainer": {"token_budget": 16 if packed else 0}})
    loss, _ = policy_loss(model, mb, LossSpec.of(cfg))
    assert torch.isfinite(loss)
