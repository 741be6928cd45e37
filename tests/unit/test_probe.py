"""Proof of serving (broker/weights/probe.py): the verdicts by hand, and the learner's probe against the
hf engine's on the tiny model, before and after a real optimiser step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflash.broker.weights.probe import (
    PROBE_TOKENS,
    LearnerProbe,
    Report,
    parse_report,
    probe_fields,
    probe_ids,
    tolerance,
    verdict,
)
from rollflash.generators.hf_engine import HFEngine
from rollflash.learner.durability.publish import learner_probe

N = PROBE_TOKENS - 1  # values: one per token after the first


def test_the_tolerance_follows_the_precision_of_either_side():
    assert tolerance("float32", "float32", None) == 1e-3
    assert tolerance("bfloat16", "float32", None) == 0.25  # rounded weights
    assert tolerance("float32", "bfloat16", None) == 0.25  # a bf16 engine
    assert tolerance("float32", "float32", 0.5) == 0.5  # weights.probe_tolerance


def test_distance_by_hand():
    learner = LearnerProbe((-2.0,) * N, "float32")
    # every token 0.002 off: mean 0.002 > 1e-3
    why = verdict(Report(4, (-2.002,) * N, "float32"), learner, None, None)
    assert why is not None and "0.002 nats from the learner's" in why and "tolerance 0.001" in why
    # 0.0005 off: within it
    assert verdict(Report(4, (-2.0005,) * N, "float32"), learner, None, None) is None
    # half the tokens 0.4 off: mean 0.2 <= 0.25 for a bfloat16 engine
    values = (-2.4,) * (N // 2) + (-2.0,) * (N - N // 2)
    assert verdict(Report(4, values, "bfloat16"), learner, None, None) is None


def test_a_probe_that_did_not_move_while_the_learners_did_is_frozen():
    old, new = LearnerProbe((-2.0,) * N, "float32"), LearnerProbe((-2.00002,) * N, "float32")
    stuck = Report(5, (-2.0,) * N, "float32")  # what it reported for v3, again
    before = (Report(3, (-2.0,) * N, "float32"), old)
    # within the tolerance (2e-5 < 1e-3), but the learner moved 2e-5 > 1e-3 / 100: frozen
    why = verdict(stuck, new, before, None)
    assert why is not None and "bit for bit its probe of v3" in why
    # a learner that moved 5e-6 (below 1e-5): an update too small to expect a change
    assert verdict(stuck, LearnerProbe((-2.000005,) * N, "float32"), before, None) is None


def test_reports_are_read_back_exactly_and_malformed_ones_refused():
    values = [-1.0 / 3.0 - k for k in range(N)]
    fields = probe_fields(7, values, "bfloat16")
    report = parse_report(fields)
    assert report == Report(7, tuple(values), "bfloat16")  # bit for bit
    assert parse_report({}) is None
    # with the report before it, of an older version
    older = Report(5, tuple(v - 1 for v in values), "bfloat16")
    with_before = parse_report(probe_fields(7, values, "bfloat16", older))
    assert with_before == Report(7, tuple(values), "bfloat16", older)
    with pytest.raises(ValueError):  # a "before" that is not older
        parse_report(probe_fields(7, values, "bfloat16", Report(7, older.values, "bfloat16")))
    with pytest.raises(ValueError):
        parse_report({**fields, "probe": "1,2"})
    with pytest.raises(ValueError):
        parse_report({**fields, "probe": ",".join(["nan"] * N)})


def test_the_probe_ids_are_the_runs():
    assert probe_ids("run-a", 100) == probe_ids("run-a", 100) != probe_ids("run-b", 100)
    assert len(probe_ids("run-a", 100)) == PROBE_TOKENS and max(probe_ids("run-a", 5)) < 5


def test_the_engine_proves_what_it_serves(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = HFEngine(str(tiny_model_dir))
    ids = probe_ids("run", model.config.vocab_size)
    cpu = torch.device("cpu")
    p0 = LearnerProbe(tuple(learner_probe(model, "run", cpu)), "float32")
    r0 = Report(0, tuple(engine.probe(ids)), engine.compute_dtype)
    assert verdict(r0, p0, None, None) is None
    # one AdamW step at lr 1e-3 on a language-modelling loss (a real update of every weight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    p1 = LearnerProbe(tuple(learner_probe(model, "run", cpu)), "float32")
    stale = Report(1, tuple(engine.probe(ids)), engine.compute_dtype)
    assert verdict(stale, p1, (r0, p0), None) is not None  # reports v1, serves v0
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    engine.swap_weights(state, 1)
    served = Report(1, tuple(engine.probe(ids)), engine.compute_dtype)
    assert verdict(served, p1, (r0, p0), None) is None
