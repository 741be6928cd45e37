"""`task.name: mixture` (envs/mixture.py): domains drawn at the weights, exact resume of every
component's position (a generated task and a dataset), scoring routed to each domain's own
reward functions, per-domain metrics, and config errors in one line."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.envs import Item, make_task, task_from_config
from rollflash.envs.mixture import BLOCK, MixtureTask
from rollflash.learner.metrics.metrics import merge_rank_metrics, reward_breakdown


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [{"question": f"say {i}", "answer": str(i)} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return str(path)


def _mixture(rows: str) -> MixtureTask:
    return make_task(
        "mixture",
        {
            "components": [
                {"task": "arithmetic", "weight": 3, "max_new_tokens": 4},
                {
                    "name": "echo",
                    "task": "dataset",
                    "weight": 1,
                    "params": {"path": rows, "prompt_key": "question", "heldout_size": 4},
                    "reward": {"functions": ["exact"]},
                },
            ]
        },
    )


def test_domains_are_drawn_at_the_weights(rows):
    task = _mixture(rows)
    n = 10 * BLOCK
    counts = Counter(it.id.split("/")[0] for it in itertools.islice(task.train_items(0), n))
    # weights 3:1 -> 0.75, 0.25; binomial sd = sqrt(10240 * 0.25 * 0.75) = 43.8; 200 > 4.5 sd
    assert abs(counts["echo"] - n * 0.25) < 200 and counts["arithmetic"] + counts["echo"] == n
    # and the positions say the same as the stream
    assert task.positions(0, n) == [counts["arithmetic"], counts["echo"]]


def test_resume_is_exact_at_any_position(rows):
    task = _mixture(rows)
    full = [it.id for it in itertools.islice(task.train_items(5), 2 * BLOCK + 100)]
    other_seed = [it.id for it in itertools.islice(task.train_items(6), len(full))]
    assert len(set(full[:20])) > 1 and full != other_seed
    for start in (0, 1, 37, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 50):
        resumed = [it.id for it in itertools.islice(task.train_items(5, start=start), 50)]
        assert resumed == full[start : start + 50], start
    # the dataset's rows come back in epochs of 26 train rows (30 - 4 held out), ids prefixed
    echo = [i for i in full if i.startswith("echo/")]
    assert len(set(echo[:26])) == 26 and all(i.startswith("echo/train-") for i in echo)


def test_heldout_interleaves_domains_and_scoring_routes_to_each_domain(rows):
    cfg = config_from_dict({"task": {"name": "mixture", "params": {"components": [
        {"task": "arithmetic", "weight": 3, "max_new_tokens": 4},
        {"name": "echo", "task": "dataset", "weight": 1, "reward": {"functions": ["exact"]},
         "params": {"path": rows, "prompt_key": "question", "heldout_size": 4}},
    ]}}})  # fmt: skip
    task = task_from_config(cfg)
    held = task.heldout_items()
    assert [h.id.split("/")[0] for h in held[:8]] == ["arithmetic", "echo"] * 4
    assert len(held) == 200 + 4  # arithmetic's 200 and the dataset's 4
    arith, echo = held[0], held[1]
    assert task.response_limit(arith) == 4 and task.response_limit(echo) is None
    # arithmetic: exact answer 1.0 + format 0.1 = 1.1; echo: `exact` on the row's answer
    got = task.score_groups([arith, echo], [[arith.answer, "x"], [echo.answer, " no"]])
    assert got == [[pytest.approx(1.1), 0.0], [1.0, 0.0]]
    assert task.score(echo, echo.answer) == 1.0
    with pytest.raises(ValueError, match="belongs to no domain"):
        task.score(Item("other/x", "p", "a"), "a")


@pytest.mark.parametrize(
    "components, message",
    [
        ([], "a non-empty list"),
        (
            [{"task": "arithmetic", "weight": 0}],
            r"components\[0\].weight: must be a finite number > 0",
        ),
        ([{"task": "arithmetic", "weight": float("inf")}], r"weight: must be a finite number > 0"),
        ([{"task": "arithmetic", "weight": float("nan")}], r"weight: must be a finite number > 0"),
        ([{"task": "arithmetic", "colour": 1}], r"components\[0\]: unknown key 'colour'"),
        ([{"task": "arithmetic"}, {"task": "arithmetic"}], "domain names repeat"),
        ([{"task": "gridworld"}], "multi-turn task 'gridworld' cannot be mixed"),
        ([{"task": "nope"}], r"components\[0\]: unknown task 'nope'"),
        ([{"task": "arithmetic", "name": "Bad Name"}], "not a short snake_case domain name"),
    ],
)
def test_config_errors_name_the_component(components, message):
    with pytest.raises(ValueError, match=message):
        make_task("mixture", {"components": components})


def _group(prompt_id: str, rewards: list[float], failures: list[str]) -> Trajectory:
    one = np.array([1], np.int32)
    samples = [
        Sample(one, np.array([-0.1], np.float32), one * 0, r, True, reward_failure=f)
        for r, f in zip(rewards, failures)
    ]
    return Trajectory(prompt_id, prompt_id, prompt_id, "g", 0, 0, one, samples)


def test_per_domain_rewards_and_failure_counts():
    groups = [
        _group("math/train-1", [1.0, 0.0], ["", ""]),
        _group("code/train-1", [0.5, 0.0], ["", "code_timeout"]),
        _group("code/train-2", [0.0, 1.0], ["code_timeout", ""]),
    ]
    got = reward_breakdown(groups)
    # math: (1 + 0) / 2; code: (0.5 + 0 + 0 + 1) / 4
    assert got == {"reward/math/mean": 0.5, "reward/code/mean": 0.375, "reward/code_timeout": 2}
    # two ranks: counts add up, a domain only one rank trained keeps that rank's mean
    merged = merge_rank_metrics(
        [(got, 3), ({"reward/code_timeout": 1, "reward/math/mean": 1.0}, 1)]
    )
    # math: (0.5 * 3 + 1.0 * 1) / 4 = 0.625; code: 0.375 from rank 0 alone
    assert merged == {
        "reward/math/mean": 0.625,
        "reward/code/mean": 0.375,
        "reward/code_timeout": 3,
    }


def test_each_reward_functions_mean_and_failures_per_step():
    """`reward/<function>`: mean of the samples that function scored; `reward/error/<function>`:
    its failures; summed over ranks like the other counts."""
    one = np.array([1], np.int32)

    def sample(reward: float, parts: dict | None) -> Sample:
        return Sample(one, np.array([-0.1], np.float32), one * 0, reward, True, reward_parts=parts)

    groups = [
        Trajectory("a", "math/train-1", "a", "g", 0, 0, one, [
            sample(1.1, {"math": 1.0, "format_ok": 1.0}),
            sample(0.1, {"math": 0.0, "format_ok": 1.0}),
        ]),
        Trajectory("b", "math/train-2", "b", "g", 0, 0, one, [
            sample(0.0, {"math": 0.0, "format_ok": None}),  # format_ok failed
            sample(1.0, {"math": 1.0, "format_ok": 0.0}),
        ]),
        Trajectory("c", "code/train-1", "c", "g", 0, 0, one, [sample(0.5, None)]),  # one function
    ]  # fmt: skip
    got = reward_breakdown(groups)
    # math: (1 + 0 + 0 + 1) / 4 = 0.5; format_ok: (1 + 1 + 0) / 3 over the three it scored
    # math domain: (1.1 + 0.1 + 0 + 1) / 4 = 0.55; code domain: 0.5
    assert got == {
        "reward/math": 0.5,
        "reward/format_ok": pytest.approx(2 / 3),
        "reward/error/format_ok": 1,
        "reward/math/mean": pytest.approx(0.55),
        "reward/code/mean": 0.5,
    }
    merged = merge_rank_metrics([(got, 3), ({"reward/error/format_ok": 2, "reward/math": 1.0}, 1)])
    # errors add up: 1 + 2; a mean is weighted by groups: (0.5 * 3 + 1.0 * 1) / 4 = 0.625
    assert merged["reward/error/format_ok"] == 3 and merged["reward/math"] == 0.625
