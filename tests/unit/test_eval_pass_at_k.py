"""pass@k (learner/evaluation/eval_generate.py): the unbiased estimator against brute force over
every k-subset, hand-worked values, and the sampled evaluation on the tiny model."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.envs import make_task
from rollflash.learner.evaluation.eval_generate import pass_at_k, sampled_eval


def brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_hand_worked_values():
    # pass@1 is c / n: 3 of 10 -> 0.3
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    # large n: no overflow; 1 - (1 - 10/1000) ... the product of 1 - k/i over i = 991..1000
    assert 0 < pass_at_k(1000, 10, 10) < 1
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_sampled_eval_on_the_tiny_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task("arithmetic", {"ops": ["+"], "heldout_size": 6})
    items = task.heldout_items()
    torch.manual_seed(123)
    expected_next = torch.rand(1).item()
    torch.manual_seed(123)
    out = sampled_eval(model, tokenizer, task, items, n_samples=4, temperature=1.0,
                       max_new_tokens=4, seed=7)  # fmt: skip
    again = sampled_eval(model, tokenizer, task, items, n_samples=4, temperature=1.0,
                         max_new_tokens=4, seed=7)  # fmt: skip
    assert torch.rand(1).item() == expected_next  # the caller's random stream is untouched
    assert set(out) == {"eval/reward_mean", "eval/pass@1", "eval/pass@4"}
    assert out == again  # evaluation has its own seed
    assert 0.0 <= out["eval/pass@1"] <= out["eval/pass@4"] <= 1.0
    # arithmetic rewards are 1.1 (correct), 0.1 (well formed) or 0
    assert 0.0 <= out["eval/reward_mean"] <= 1.1
