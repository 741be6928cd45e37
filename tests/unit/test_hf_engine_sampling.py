"""The HF engine's behaviour log-probs are the distribution it samples from, whatever the
checkpoint's generation_config.json asks for (generators/hf_engine.py)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from rollflash.broker.config.generation import ignored_generation_settings
from rollflash.generators.hf_engine import HFEngine
from rollflash.generators.sampling import SamplingParams

T = 0.7
PROMPTS = ["1+2=", "33+4=", "7*8="]
# what instruct checkpoints ship, made strong enough to show on a tiny model: each of these, if
# applied, moves the distribution away from softmax(logits / T)
SHIPPED = {
    "do_sample": True,
    "temperature": 0.3,
    "top_k": 3,
    "repetition_penalty": 1.5,
    "no_repeat_ngram_size": 1,
    "min_new_tokens": 4,
}


@pytest.fixture
def shipping_model(tiny_model_dir, tmp_path):
    """The tiny model with a generation_config.json that sets SHIPPED."""
    out = tmp_path / "shipping"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **SHIPPED}))
    return out


def _recording_multinomial(monkeypatch) -> list[torch.Tensor]:
    """Record the probability rows transformers' sampler draws from: `generate` samples each
    step with torch.multinomial(softmax(processed scores)), so these rows are the sampler's
    distribution, after every logits processor the generation config switched on."""
    rows: list[torch.Tensor] = []
    draw = torch.multinomial

    def recording(probs, *args, **kwargs):
        rows.append(probs.detach().clone())
        return draw(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recording)
    return rows


def test_reported_logprobs_are_the_samplers_distribution(shipping_model, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="rollflash.generators.hf_engine"):
        engine = HFEngine(str(shipping_model))
    # the checkpoint's settings are named once, in one line; the ids it needs are not
    warned = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    for key, value in SHIPPED.items():
        assert (f"{key}={value}" in warned[0]) == (key != "do_sample"), key

    steps = _recording_multinomial(monkeypatch)
    torch.manual_seed(0)
    groups = engine.generate(
        PROMPTS, SamplingParams(n=4, temperature=T, top_p=1.0, max_new_tokens=8)
    )
    samples = [s for g in groups for s in g]  # row r of the batch is sample r (group-major)
    assert len(steps) == max(len(s.response_ids) for s in samples) and len(steps) >= 2

    repeats = 0
    for r, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(s.prompt_ids) - 1 : -1].float()  # [S, V]
        expected = torch.log_softmax(logits / T, dim=-1)  # what the learner recomputes
        response = torch.tensor(s.response_ids)
        reported = torch.tensor(s.logprobs)
        # the reported log-probs are the learner's quantity ...
        torch.testing.assert_close(
            reported, expected.gather(-1, response[:, None])[:, 0], atol=1e-4, rtol=0
        )
        # ... and the distribution every token was drawn from, row for row (a repetition
        # penalty rescales logits of seen tokens, no_repeat_ngram_size 1 and top_k 3 zero out
        # tokens, min_new_tokens zeroes EOS: each would differ here)
        for t in range(len(s.response_ids)):
            torch.testing.assert_close(steps[t][r], expected[t].exp(), atol=1e-5, rtol=0)
        repeats += len(s.response_ids) - len(set(s.response_ids))
    # tokens repeat in the responses: the no-repeat and repetition-penalty processors, had they
    # run, would have changed these draws
    assert repeats > 0


def test_only_settings_that_change_the_draw_are_reported():
    from transformers import GenerationConfig

    shipped = GenerationConfig(
        eos_token_id=[2, 7], pad_token_id=0, top_p=1.0, repetition_penalty=1.05, max_length=4096
    )
    # top_p 1.0 is transformers' default (no effect); lengths and the pad id do not change a
    # draw; the extra EOS id 7 would end responses the learner sees continuing
    assert ignored_generation_settings(shipped, eos_id=2) == {
        "repetition_penalty": 1.05,
        "eos_token_id": [2, 7],
    }
    assert ignored_generation_settings(GenerationConfig(eos_token_id=2, pad_token_id=0), 2) == {}


def test_the_learners_evaluation_generates_with_the_runs_settings_only(
    shipping_model, tiny_model_dir, caplog
):
    """The learner's policy, loaded from a checkpoint that ships SHIPPED, answers the held-out
    prompts greedily exactly as the same weights without it: no repetition penalty, no n-gram
    ban (which would forbid the 3 of "33+4=" in "37"), no minimum length."""
    from rollflash.broker.config.config import config_from_dict
    from rollflash.envs.chat import encode_prompts
    from rollflash.learner.evaluation.eval_generate import greedy_ids
    from rollflash.learner.models.policy import load_policy

    answers = []
    for path in (tiny_model_dir, shipping_model):
        with caplog.at_level(logging.WARNING, logger="rollflash.learner.models.policy"):
            model, tokenizer = load_policy(config_from_dict({"model": {"path": str(path)}}))
        contexts = encode_prompts(tokenizer, PROMPTS)
        answers.append(greedy_ids(model, tokenizer, contexts, max_new_tokens=6))
    assert answers[0] == answers[1]
    warned = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert len(warned) == 1 and "repetition_penalty=1.5" in warned[0]
