"""Tied parameters stay one parameter through the learner's meta-device build (learner/models/load.py),
and a model whose config says tied but whose build is not is refused at start-up. The builds of
several ranks (DDP and FSDP2) are covered with real processes in
tests/integration/test_distributed_learner.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollflash.learner.models.load import check_tied, materialise, params_on_meta
from rollflash.learner.process.dist import full_state_dict, tied_parameters


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def test_meta_build_and_materialise_keep_the_tie(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.tie_word_embeddings
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight.is_meta and _tied(model)
    assert tied_parameters(model) == [["model.embed_tokens.weight", "lm_head.weight"]]
    rotary = [b for b in model.buffers() if not b.is_meta]
    assert rotary  # buffers the constructor computes stay real
    materialise(model, torch.device("cpu"))
    assert not model.lm_head.weight.is_meta and _tied(model)
    check_tied(model)


def test_an_untied_build_of_a_tied_config_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    check_tied(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(RuntimeError, match="tie_word_embeddings"):
        check_tied(model)


def test_a_version_stores_the_tied_tensor_once(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = full_state_dict(model)
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
