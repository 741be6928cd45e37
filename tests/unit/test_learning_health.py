"""Learning health (learner/metrics/health.py): final answers as the task's verifier reads them
(envs/answers.py), the share of groups that all answer alike, the held-out set's most common
answer and the accuracy of always giving it, the two warnings, and the start-up check that a
right answer can reach `eval.threshold`. Unit-level: the tasks are the real ones a config
builds (task_from_config); the evaluations are given as the responses a model would write."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.envs import make_task, task_from_config
from rollflash.envs.answers import final_answer
from rollflash.envs.verifiers import math_answer
from rollflash.learner.metrics.health import (
    OPPOSED_EVALS,
    HealthWatch,
    same_answer_frac,
    step_health,
    threshold_warning,
    top_answer,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She sold 72 clips.\n#### 1,234", "1234"),  # GSM8K marker first
        ("so \\boxed{\\frac{1}{2}} and 3", "\\frac{1}{2}"),  # the last boxed, nested braces
        ("first 12, then 1,500 apples", "1500"),  # the last number
        ("-3.5 degrees", "-3.5"),
        ("  no number here ", "no number here"),
    ],
)
def test_math_answer_reads_what_the_math_verifier_reads(text, expected):
    assert math_answer(text) == expected


def test_final_answers_follow_the_tasks_verifier():
    exact = task_from_config(config_from_dict({"reward": {"functions": ["exact"]}}))
    math = task_from_config(config_from_dict({"reward": {"functions": ["math", "exact"]}}))
    assert final_answer(exact, "x", " 42 ") == "42"  # no final_answer: the stripped response
    assert final_answer(math, "x", "it is 40 + 2 = 42") == "42"
    assert final_answer(make_task("arithmetic"), "x", "42\n") == "42"
    mixture = make_task(
        "mixture",
        {"components": [{"task": "arithmetic", "name": "add"}, {"task": "oneliner"}]},
    )
    assert final_answer(mixture, "add/heldout-0000001", " 7") == "7"


def test_same_answer_frac_counts_groups_of_two_or_more():
    # groups: all "1" (same), "1","2" (not), one sample (left out), all "" (same) -> 2 of 3
    groups = [["1", "1", "1"], ["1", "2"], ["5"], ["", ""]]
    assert same_answer_frac(groups) == pytest.approx(2 / 3)
    assert same_answer_frac([["5"]]) is None


def _group(prompt_id: str, texts: list[str]) -> Trajectory:
    one = np.zeros(1, dtype=np.int32)
    samples = [Sample(one, np.zeros(1, np.float32), one, 0.0, True, t) for t in texts]
    return Trajectory("t", prompt_id, "g", "gen-0", 0, 0, one, samples)


def test_step_health_reads_each_samples_final_answer():
    task = task_from_config(config_from_dict({"reward": {"functions": ["math"]}}))
    groups = [
        _group("a", ["so 12", "#### 12", "\\boxed{12}"]),  # three ways to say 12: same
        _group("b", ["12", "13"]),
    ]
    assert step_health(task, groups) == {"health/same_answer_frac": 0.5}  # 1 of 2 groups


# A task built so that the majority answer is right 80% of the time: 100 held-out rows, 80 of
# them answered "1", the other 20 "2" to "5" (5 each).
ANSWERS = ["1"] * 80 + [str(2 + i // 5) for i in range(20)]


@pytest.fixture
def majority_task(tmp_path):
    rows = [{"prompt": f"count {i}", "answer": a} for i, a in enumerate(ANSWERS)]
    for name in ("train", "test"):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    params = {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "test.jsonl")}
    cfg = config_from_dict(
        {"task": {"name": "dataset", "params": params}, "reward": {"functions": ["exact"]}}
    )
    task = task_from_config(cfg)
    return task, task.heldout_items()


def _evaluate(watch, task, items, step, responses, reward):
    """One evaluation as the learner makes it: the step rewards since the last one, accuracy at
    eval.threshold 1.0, the most common answer and the watch's verdict."""
    if step:
        watch.step(reward)
    accuracy = sum(task.score(it, r) >= 1.0 for it, r in zip(items, responses)) / len(items)
    return accuracy, watch.evaluated(step, accuracy, top_answer(task, items, responses, 1.0))


def test_a_run_that_collapses_to_the_majority_answer_is_flagged(majority_task, caplog):
    task, items = majority_task
    watch = HealthWatch(len(items))
    wrong = ["9"] * 100  # the start: every answer wrong
    with caplog.at_level(logging.WARNING, logger="rollflash.learner.metrics.health"):
        acc0, m0 = _evaluate(watch, task, items, 0, wrong, None)
        # half collapsed: "1" on rows 0-49 (right), "9" on the rest -> accuracy 0.5; "1" and "9"
        # are 50 each, the first of them ("1") is the top answer, right on 80 of 100 rows
        acc1, m1 = _evaluate(watch, task, items, 10, ["1"] * 50 + ["9"] * 50, 0.4)
        # collapsed: "1" everywhere -> accuracy 0.8, exactly the accuracy of always saying "1"
        acc2, m2 = _evaluate(watch, task, items, 20, ["1"] * 100, 0.8)
        acc3, m3 = _evaluate(watch, task, items, 30, ["1"] * 100, 0.8)
    assert (acc0, acc1, acc2) == (0.0, 0.5, 0.8)
    assert m1["eval/top_answer_share"] == 0.5 and m1["eval/top_answer_acc"] == 0.8
    assert m1["health/majority"] == 0.0  # gives "1" less often (0.5) than it is right (0.8)
    assert m2["eval/top_answer_share"] == 1.0 and m2["eval/top_answer_acc"] == 0.8
    assert m2["health/majority"] == 1.0 and m3["health/majority"] == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # warned once, when it started
    assert (
        "step 20: held-out accuracy 0.800 is no better than always answering '1' (0.800)"
        in (lines[0])
    )
    assert watch.warnings == [lines[0].removeprefix("learning health: ")]


def test_a_run_that_learns_is_not_flagged(majority_task, caplog):
    task, items = majority_task
    watch = HealthWatch(len(items))
    with caplog.at_level(logging.WARNING, logger="rollflash.learner.metrics.health"):
        _evaluate(watch, task, items, 0, ["9"] * 100, None)
        # learning: right on the first k rows of each kind; "1" is right wherever it is given
        for step, k in ((10, 20), (20, 60), (30, 100)):
            responses = [a if i < k else "9" for i, a in enumerate(ANSWERS)]
            acc, m = _evaluate(watch, task, items, step, responses, k / 100)
            assert m["health/majority"] == 0.0, (step, m)
    # the end: every row right (1.0) beats always saying "1" (0.8), which it gives 80% of the time
    assert acc == 1.0 and m["eval/top_answer_share"] == 0.8 and m["eval/top_answer_acc"] == 0.8
    assert not caplog.records and watch.warnings == []


def test_reward_up_and_accuracy_down_for_several_evaluations_is_flagged(caplog):
    watch = HealthWatch(heldout_size=200)
    rewards = [None, 0.30, 0.40, 0.50, 0.60, 0.70]
    accuracy = [0.50, 0.50, 0.45, 0.40, 0.30, 0.20]
    counts = []
    with caplog.at_level(logging.WARNING, logger="rollflash.learner.metrics.health"):
        for step, (r, a) in enumerate(zip(rewards, accuracy)):
            if r is not None:
                watch.step(r)
            counts.append(watch.evaluated(10 * step, a, None)["health/opposed_evals"])
    # moves between rated evaluations (steps 10..50): reward up each time, accuracy
    # 0.50 -> 0.45 -> 0.40 -> 0.30 -> 0.20 down each time: 0, 1, 2, 3, 4 in a row
    assert counts == [0, 0, 1, 2, 3, 4]
    (line,) = [r.getMessage() for r in caplog.records]
    # raised at the third: accuracy 0.45 -> 0.30 over the window, more than two standard errors
    # at 200 items: 2 * sqrt(0.375 * 0.625 / 200) = 0.068 < 0.15
    assert OPPOSED_EVALS == 3
    assert "step 40: the reward rose and held-out accuracy fell at each of the last 3" in line
    assert "reward 0.300 -> 0.600, accuracy 0.500 -> 0.300" in line


def test_opposed_moves_within_sampling_noise_are_not_flagged(caplog):
    watch = HealthWatch(heldout_size=200)
    with caplog.at_level(logging.WARNING, logger="rollflash.learner.metrics.health"):
        watch.evaluated(0, 0.50, None)
        for step, (r, a) in enumerate(zip([0.3, 0.4, 0.5, 0.6], [0.52, 0.51, 0.50, 0.49]), 1):
            watch.step(r)
            out = watch.evaluated(step, a, None)
    # three opposed moves, but accuracy 0.52 -> 0.49 over them: 0.03 < 2 * sqrt(0.25 / 200) = 0.07
    assert out["health/opposed_evals"] == 3
    assert not caplog.records and watch.warnings == []


def test_an_evaluation_of_weights_already_evaluated_adds_no_trend_point():
    watch = HealthWatch(heldout_size=100)
    watch.evaluated(0, 0.1, None)
    watch.step(0.5)
    watch.evaluated(10, 0.2, None)
    watch.evaluated(10, 0.2, None)  # the final evaluation of the step the loop evaluated
    assert watch.points == [(None, 0.1), (0.5, 0.2)]


def test_a_threshold_no_right_answer_reaches_warns_in_one_line():
    """The README's former example: exact plus a length penalty of 0.01 a character puts a right
    two-digit answer at 0.98 and a three-digit one at 0.97, under eval.threshold 1.0."""
    task = make_task("arithmetic")
    items = task.heldout_items()
    from rollflash.envs.reward_functions import RewardFunctions
    from rollflash.envs.scored_task import ScoredTask

    penalty = RewardFunctions(
        ["exact", "python:length"],
        [lambda p, r, a, **row: float(r.strip() == a), lambda p, r, a, **row: -0.01 * len(r)],
        [1.0, 1.0],
    )
    warning = threshold_warning(ScoredTask(task, penalty), items, 1.0)
    best = max(items[:8], key=lambda it: -len(it.answer))  # the shortest answer scores most
    assert warning is not None and "\n" not in warning
    assert warning.startswith("eval.threshold: 1 is above what a right answer scores")
    assert f"score at most {1 - 0.01 * len(best.answer):.4g}" in warning
    assert threshold_warning(ScoredTask(task, penalty), items, 0.9) is None
    bonus = RewardFunctions(
        ["exact", "python:digits"],
        [lambda p, r, a, **row: float(r == a), lambda p, r, a, **row: 0.1 * r.isdigit()],
        [1.0, 1.0],
    )
    assert threshold_warning(ScoredTask(task, bonus), items, 1.0) is None
    assert threshold_warning(task, items, 1.0) is None  # the task's own reward: 1.1 >= 1.0
    assert threshold_warning(task, items, 1.2) is not None  # above it: 1.1 < 1.2
    # a task that cannot write a right answer is not checked: a pattern is no response
    regex = task_from_config(config_from_dict({"reward": {"functions": ["regex"]}}))
    assert threshold_warning(regex, items, 5.0) is None
