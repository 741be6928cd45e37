"""The generated code task of configs/mixture.yaml (envs/oneliner.py), scored by the code verifier
in the real sandbox: the reference program passes, the teacher's swapped program passes x = 1
only, a broken one scores 0 with its reason; identical programs of one batch run once.

Skipped only with ROLLFLASH_SKIP_SANDBOX_TESTS=1 (never in CI); without bubblewrap they fail."""

from __future__ import annotations

import itertools
import os

import pytest

from rollflash.envs import make_task
from rollflash.envs.code_verifier import CodeVerifier
from rollflash.envs.scored import failure_of
from scripts.make_mixture_model import near_miss
from scripts.make_tiny_model import CHARS, sft_items

sandbox = pytest.mark.skipif(
    os.environ.get("ROLLFLASH_SKIP_SANDBOX_TESTS") == "1", reason="ROLLFLASH_SKIP_SANDBOX_TESTS=1"
)


def test_items_tests_and_heldout_are_computed_from_a_and_b():
    task = make_task("oneliner", {"heldout_size": 50})
    item = next(task.train_items(0))
    a, b = (int(v) for v in item.prompt.removeprefix("code x*").removesuffix("=").split("+"))
    assert 2 <= a <= 9 and 10 <= b <= 99 and item.id == "train-000000"
    assert item.answer == f"print(int(input())*{a}+{b})"
    # x = 1 -> a + b, x = 7 -> 7a + b
    assert item.extra["tests"] == [
        {"input": "1\n", "output": f"{a + b}\n"},
        {"input": "7\n", "output": f"{7 * a + b}\n"},
    ]
    heldout = {it.prompt for it in task.heldout_items()}
    train = {it.prompt for it in itertools.islice(task.train_items(3), 2000)}
    assert len(heldout) == 50 and not heldout & train
    # every prompt and program is written in the tiny tokenizer's characters
    assert set(item.prompt + item.answer) <= set(CHARS)
    with pytest.raises(ValueError, match="heldout_size must be in"):
        make_task("oneliner", {"a_range": [2, 3], "b_range": [10, 11], "heldout_size": 3})
    with pytest.raises(ValueError, match="inputs must be distinct ints"):
        make_task("oneliner", {"inputs": [1, 1]})


def test_the_teacher_swaps_a_and_b_and_keeps_the_integer_rule():
    assert near_miss("print(int(input())*7+25)") == "print(int(input())*25+7)"
    assert near_miss("41") == "42" and near_miss("-3") == "-2"
    task = make_task("oneliner", {"heldout_size": 10})
    clean = list(itertools.islice(task.train_items(0), 20))
    always = list(itertools.islice(sft_items(task, 0, 0.99, near_miss), 20))
    assert [it.prompt for it in always] == [it.prompt for it in clean]
    # seed 0: the draws of random.Random(1) are all below 0.99 for these 20 items
    assert [a.answer for a in always] == [near_miss(c.answer) for c in clean]


@sandbox
def test_reference_swapped_and_broken_programs_score_in_the_sandbox():
    task = make_task("oneliner", {"heldout_size": 10})
    item = task.heldout_items()[0]
    swapped = near_miss(item.answer)
    scores = task.score_groups([item], [[item.answer, swapped, "print(int(input())*", ""]])[0]
    # reference: 2/2 tests; swapped: x = 1 gives b + a = a + b (pass), x = 7 differs (a != b)
    assert [float(s) for s in scores] == [1.0, 0.5, 0.0, 0.0]
    assert [failure_of(s) for s in scores] == ["", "", "code_syntax", "code_no_program"]


@sandbox
def test_identical_programs_in_a_batch_run_once(monkeypatch):
    verifier = CodeVerifier()
    runs: list[str] = []
    score_one = verifier._score_one

    def counted(response, tests):
        runs.append(response)
        return score_one(response, tests)

    monkeypatch.setattr(verifier, "_score_one", counted)
    one = [{"input": "2\n", "output": "4\n"}]
    other = [{"input": "3\n", "output": "6\n"}]
    double = "print(int(input())*2)"
    fenced = f"```python\n{double}\n```"  # the same program once its fence is taken off
    out = verifier(
        ["p"] * 4, [double, fenced, double, double], [""] * 4, tests=[one, one, other, one]
    )
    verifier.close()
    # distinct (program, tests): (double, one) and (double, other) -> two runs, four scores
    assert len(runs) == 2 and [float(s) for s in out] == [1.0, 1.0, 1.0, 1.0]
