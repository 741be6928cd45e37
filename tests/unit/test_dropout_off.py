"""Dropout is off in the policy (learner/models/dropout.py), so the proximal pass and the updates of a
step compute the same log-probs from the same weights: with LoRA dropout 0.1 and M = 2 the first
update's ratio is exactly 1. The learner is built by learner/build.py's builders."""

from __future__ import annotations

import json
import shutil

import torch
from transformers import AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.models.dropout import disable_dropout
from rollflash.learner.process.dist import Dist
from rollflash.learner.step import train as train_module
from rollflash.learner.step.logprobs import token_logprobs
from tests.unit.test_learner_train import MIXED, _groups

LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj"], "dropout": 0.1}


def _first_update(model_dir, disable_dropout: bool = True) -> dict[str, float]:
    """The metrics of the first of a step's M = 2 updates, LoRA dropout 0.1."""
    cfg = config_from_dict(
        {
            "model": {"path": str(model_dir), "lora": LORA},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {
                "micro_batch_size": 4,
                "rollout_batch_size": 3,
                "ppo_mini_batches": 2,
                "disable_dropout": disable_dropout,
            },
        }
    )
    torch.manual_seed(0)
    models = build_models(cfg, Dist())
    with torch.no_grad():  # adapters that have moved: with B = 0 the adapter path (dropout
        for name, p in models.policy.named_parameters():  # included) adds exactly nothing
            if "lora_B" in name:
                p.normal_(0, 0.3)
    optim = build_optim(cfg, models)
    tok = AutoTokenizer.from_pretrained(model_dir)
    updates: list[dict[str, float]] = []
    update = train_module.policy_update

    def recording(*args, **kwargs):
        sums = update(*args, **kwargs)
        updates.append(sums.values())
        return sums

    train_module.policy_update = recording
    try:
        groups = _groups(models.policy, tok, MIXED)
        train_module.train_step(models.model, optim.optimizer, groups, cfg, models.algo)
    finally:
        train_module.policy_update = update
    assert len(updates) == 2
    return updates[0]


def test_lora_dropout_leaves_the_first_updates_ratio_exactly_1(tiny_model_dir):
    first = _first_update(tiny_model_dir)
    assert first["policy/ratio_max"] == 1.0 and first["policy/ratio_mean"] == 1.0
    assert first["policy/clip_frac"] == 0.0 and first["policy/approx_kl"] == 0.0


def test_with_disable_dropout_false_the_first_ratio_moves(tiny_model_dir):
    # the check above can fail, and the key switches: the same step with LoRA's dropout on
    first = _first_update(tiny_model_dir, disable_dropout=False)
    assert first["policy/ratio_max"] > 1.0 and first["policy/approx_kl"] > 0.0


def test_a_base_models_own_dropout_is_off_too(tiny_model_dir, tmp_path):
    # a checkpoint whose config asks for attention dropout 0.5, applied by transformers as a
    # function of the layer's float `attention_dropout` in train mode
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    cfg = config_from_dict({"model": {"path": str(tmp_path / "m")}})
    policy = build_models(cfg, Dist()).policy
    rates = [m.attention_dropout for m in policy.modules() if hasattr(m, "attention_dropout")]
    assert rates and all(r == 0.0 for r in rates)
    policy.train()  # as the updates run it: two passes give the same log-probs
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    a, b = (token_logprobs(policy, ids, torch.ones_like(ids), 1.0)[0] for _ in range(2))
    assert torch.equal(a, b)


def test_disable_dropout_zeroes_modules_and_float_rates():
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Dropout1d(0.2)
    )
    model[0].attention_dropout = 0.1  # as a transformers attention layer holds it
    disable_dropout(model)
    assert model[1].p == 0.0 and model[2].p == 0.0 and model[0].attention_dropout == 0.0
