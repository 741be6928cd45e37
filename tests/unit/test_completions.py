"""Which samples are logged as completions: best, worst, then random, worked by hand."""

import numpy as np

from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.metrics.completions import pick_completions


def _group(gid, rewards, behavior_version=3, generator="gen-0"):
    samples = [
        Sample(
            response_ids=np.array([7, 8][: 1 + i % 2], dtype=np.int32),
            logprobs=np.zeros(1 + i % 2, dtype=np.float32),
            token_versions=np.full(1 + i % 2, behavior_version, dtype=np.int32),
            reward=r,
            finished=True,
            text=f"{gid}-{i}",
        )
        for i, r in enumerate(rewards)
    ]
    return Trajectory(gid, f"p-{gid}", gid, generator, behavior_version, behavior_version,
                      np.array([1, 2, 3], dtype=np.int32), samples)  # fmt: skip


def decode(ids):
    return ",".join(map(str, ids))


def test_best_then_worst_then_random_distinct_samples():
    groups = [_group("a", [0.5, 1.0, 0.0]), _group("b", [0.25, 0.75], behavior_version=2)]
    rows = pick_completions(groups, 4, version=4, seed=0, step=7, decode=decode)
    assert [r["pick"] for r in rows] == ["best", "worst", "random", "random"]
    assert rows[0]["response"] == "a-1" and rows[0]["reward"] == 1.0
    assert rows[1]["response"] == "a-2" and rows[1]["reward"] == 0.0
    # the random two come from the three others, never twice the same
    randoms = [r["response"] for r in rows[2:]]
    assert len(set(randoms)) == 2 and set(randoms) <= {"a-0", "b-0", "b-1"}
    b0 = pick_completions(groups[1:], 1, version=4, seed=0, step=7, decode=decode)[0]
    # staleness = learner version at collection (4) - behaviour version (2)
    assert (b0["staleness"], b0["behavior_version"], b0["generator"]) == (2, 2, "gen-0")
    assert b0["prompt"] == "1,2,3" and b0["reward_parts"] == [0.75]


def test_same_step_same_picks_and_nothing_when_off():
    groups = [_group("a", [0.1 * i for i in range(8)])]
    one = pick_completions(groups, 5, version=3, seed=1, step=2, decode=decode)
    assert one == pick_completions(groups, 5, version=3, seed=1, step=2, decode=decode)
    assert len(one) == 5
    assert pick_completions(groups, 0, version=3, seed=1, step=2, decode=decode) == []
    assert pick_completions([], 3, version=3, seed=1, step=2, decode=decode) == []
    # n larger than the step: every sample once
    assert len(pick_completions(groups, 20, version=3, seed=1, step=2, decode=decode)) == 8
