"""scripts/make_tiny_model.py builds a standard HF dir that the Auto classes load back."""

import itertools
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.envs import make_task
from scripts.make_tiny_model import build_tokenizer, main, sft_items


def test_build_and_load_back(tmp_path, capsys):
    out = tmp_path / "tiny"
    main(
        [
            "--out",
            str(out),
            "--sft-steps",
            "3",
            "--sft-batch-size",
            "8",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--threads",
            "1",
            "--seed",
            "0",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sft_steps"] == 3 and 0.0 <= summary["heldout_acc"] <= 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert tok.pad_token_id == model.config.pad_token_id == 0
    assert tok.eos_token_id == model.config.eos_token_id == 2
    assert tok.padding_side == "left"

    ids = tok("17+25=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("17+25=")  # <bos> + one id per char
    assert tok.decode(ids, skip_special_tokens=True) == "17+25="

    enc = tok(["1+1=", "10+10="], return_tensors="pt", padding=True)
    assert enc["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]  # left padded
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, 7, len(tok)) and torch.isfinite(logits).all()


def test_deterministic_for_a_seed(tmp_path, capsys):
    args = [
        "--sft-steps",
        "2",
        "--sft-batch-size",
        "4",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--threads",
        "1",
        "--seed",
        "3",
        "--no-eval",
    ]
    main(["--out", str(tmp_path / "a"), *args])
    main(["--out", str(tmp_path / "b"), *args])
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)


def test_teacher_error_shifts_answers_by_one():
    task = make_task("arithmetic", {"ops": ["+"], "heldout_size": 10})
    clean = list(itertools.islice(task.train_items(0), 200))
    assert list(itertools.islice(sft_items(task, 0, 0.0), 200)) == clean
    noisy = list(itertools.islice(sft_items(task, 0, 0.6), 200))
    assert noisy == list(itertools.islice(sft_items(task, 0, 0.6), 200))  # deterministic per seed
    assert [it.prompt for it in noisy] == [it.prompt for it in clean]
    offsets = [int(n.answer) - int(c.answer) for n, c in zip(noisy, clean)]
    # The shift is a fixed function of the seed, not a sample to bound: item i is shifted iff the
    # i-th draw of random.Random(seed + 1) is below teacher_error. The slow reference below replays
    # those draws; for seed 0 and 0.6 it shifts 128 of the 200 (items 0, 3, 4, 5, 8, 9, ...).
    draws = random.Random(0 + 1)
    expected = [int(draws.random() < 0.6) for _ in range(200)]
    assert offsets == expected
    assert sum(offsets) == 128 and offsets[:10] == [1, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # teacher_error 1.0 shifts every answer by exactly one
    always = itertools.islice(sft_items(task, 0, 1.0), 200)
    assert [int(a.answer) - int(c.answer) for a, c in zip(always, clean)] == [1] * 200


def test_target_acc_zero_stops_at_first_check(tmp_path, capsys):
    main(
        [
            "--out",
            str(tmp_path / "t"),
            "--sft-steps",
            "100",
            "--sft-target-acc",
            "0",
            "--sft-batch-size",
            "4",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--no-eval",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sft_steps"] == 25  # first validation check (every 25 steps) meets a 0.0 target


def test_special_tokens_inside_a_response_are_not_skipped_when_scoring():
    """A policy must not earn the reward for "4<pad>2" as if it had written "42"."""
    from rollflash.envs import Item, make_task, response_text

    tok = build_tokenizer()
    task = make_task("arithmetic", {"ops": ["+"]})
    item = Item(id="x", prompt="40+2=", answer="42")
    digits = tok("42", add_special_tokens=False)["input_ids"]
    honest = digits + [tok.eos_token_id, tok.pad_token_id]
    gamed = [digits[0], tok.pad_token_id, digits[1], tok.eos_token_id]
    assert response_text(tok, honest, tok.eos_token_id) == "42"
    assert task.score(item, response_text(tok, honest, tok.eos_token_id)) == pytest.approx(1.1)
    assert task.score(item, response_text(tok, gamed, tok.eos_token_id)) == 0.0
