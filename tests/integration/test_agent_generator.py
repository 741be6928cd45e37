"""A generator running an agent program (`rollout.agent`) against a real Redis: its pulls become
whole groups on the trajectories stream, each prompt acknowledged with its group, failures
counted; the sim engine answers the calls (its tokens are meaningless, the bookkeeping is not)."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.connect.keys import GEN_GROUP, RunKeys
from rollflash.broker.wire.schema import PromptWork
from rollflash.rollctl.status import show_status
from tests.helpers.brokers import joined

VOCAB = 64


def _cfg(tmp_path, redis_url, run_id, **rollout):
    return config_from_dict({
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run")},
        "redis": {"url": redis_url},
        "rollout": {"engine": "sim", "num_return_sequences": 4, "prompts_per_pull": 2,
                    "max_new_tokens": 4, **rollout},
        "sim": {"per_token_s": 0.0005, "length_median": 3, "vocab_size": VOCAB},
    })  # fmt: skip


def _work(i: int) -> PromptWork:
    item = {"id": f"train-{i}", "prompt": f"question {i}", "answer": "1", "extra": {}}
    return PromptWork(f"train-{i}", f"g{i:09d}", 4, 0, item)


def _pull(learner, gen, n_prompts):
    learner.add_prompts([_work(i) for i in range(n_prompts)])
    gen.serve_once()
    good, bad = learner.read_trajectories("rank0", 10, 100, (VOCAB, 4, 0))
    assert bad == []
    return [t for _, t in good]


def test_agent_groups_are_streamed_whole_and_their_prompts_acknowledged(
    tmp_path, redis_url, run_id, capsys
):
    cfg = _cfg(tmp_path, redis_url, run_id, agent="tests.helpers.agents:two_calls",
               redundant_samples=1)  # fmt: skip
    with joined(cfg, "gen-a") as (learner, gen):
        try:
            trajs = _pull(learner, gen, 2)
            gen.heartbeat("up")
            show_status(cfg, as_json=False)
        finally:
            gen.agents.close()
    assert sorted(t.traj_id for t in trajs) == ["g000000000", "g000000001"]
    r = redis.Redis.from_url(redis_url)
    assert r.xpending(RunKeys(run_id).prompts, GEN_GROUP)["pending"] == 0  # acked with them
    for traj in trajs:
        assert len(traj.samples) == 4  # n kept of the n + 1 started
        for s in traj.samples:
            # two calls, one sequence: two turns, the mask 1 from each turn's start
            assert len(s.turn_starts) == 2 and s.loss_mask[s.turn_starts].all()
            assert s.reward == 1.0 and s.reward_failure == "" and s.env_errors == 0
            assert list(s.turn_rewards) == [0.0, 1.0]
            # the sim engine's codec: "tool: result 0" written between the turns, unmasked
            between = s.loss_mask[s.turn_starts[0] : s.turn_starts[1]]
            assert between.sum() < len(between) and np.all(s.token_versions == 0)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("generator gen-a"))
    # 8 episodes kept; the 2 redundant ones were cancelled or finished after their group
    assert "agent: calls=" in line and "fallbacks=0" in line, line
    assert gen.agents.heartbeat_fields()["agent_metric_turns"] == 2.0


@pytest.mark.parametrize("timeout", [0.5, None])
def test_agent_timeout_ends_episodes_as_env_errors(tmp_path, redis_url, run_id, timeout):
    """Each episode sleeps 1.5 s after its call: past a 0.5 s limit, within the default 600 s."""
    limit = {} if timeout is None else {"agent_timeout_s": timeout}
    cfg = _cfg(tmp_path, redis_url, run_id, agent="tests.helpers.agents:slow", **limit)
    with joined(cfg, "gen-t") as (learner, gen):
        try:
            (traj,) = _pull(learner, gen, 1)
        finally:
            gen.agents.close()
    if timeout is None:
        assert [(s.reward, s.reward_failure) for s in traj.samples] == [(1.0, "")] * 4
        return
    assert [s.reward_failure for s in traj.samples] == ["agent_timeout"] * 4
    assert [s.env_errors for s in traj.samples] == [1] * 4
    assert all(s.reward == 0.0 and s.loss_mask.sum() > 0 for s in traj.samples)
    assert gen.agents.heartbeat_fields()["agent_timeouts"] == 4


def test_interrupt_refills_the_pull_with_new_prompts(tmp_path, redis_url, run_id):
    """rollout.interrupt: each streamed group claims one more prompt into the running pull."""
    cfg = _cfg(tmp_path, redis_url, run_id, agent="tests.helpers.agents:two_calls",
               interrupt=True, prompts_per_pull=1)  # fmt: skip
    with joined(cfg, "gen-r") as (learner, gen):
        try:
            trajs = _pull(learner, gen, 3)  # one serve_once: the pull of 1 grows to 3
        finally:
            gen.agents.close()
    assert sorted(t.traj_id for t in trajs) == ["g000000000", "g000000001", "g000000002"]
