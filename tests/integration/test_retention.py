"""Redis stays flat: what the learner trims, on a real redis-server (broker/channels/retention.py,
broker/channels/roster.py). Each retention key is shown to act: `redis.keep_acknowledged_s` (acknowledged
trajectories readable for that long, then trimmed), `redis.dlq_max_entries` and
`redis.dlq_max_age_s` (the dead letters' own retention)."""

import time

import numpy as np
import pytest
import redis

from rollflash.broker.channels.streams import Rejected
from rollflash.broker.config.config import load_config
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from tests.helpers.brokers import admit, generator

CHECK = (10, 1, 0)


def _learner(url, run_id, **kw) -> LearnerBroker:
    b = LearnerBroker(connect(url, 5.0), run_id, 100_000, **kw)
    b.take_lease()
    b.ensure_groups()
    b.register_run(load_config(None).fingerprint())
    b.track_trajectory_writes()
    return b


def _answer_all(learner, gen, n: int) -> list[str]:
    """Issue n prompts, answer them, read and acknowledge them as trained; returns the refs."""
    works = [
        PromptWork(f"p{i}", f"g{i}", 1, 0, {"id": f"p{i}", "prompt": "1+1="}) for i in range(n)
    ]
    learner.add_prompts(works)
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    for entry_id, w in gen.claim_prompts(n, block_ms=100):
        t = Trajectory(
            w.group_id,
            w.prompt_id,
            w.group_id,
            gen.id,
            0,
            0,
            np.array([1], np.int32),
            [s],
            mac=w.mac,
        )
        gen.add_trajectory(t, entry_id)
    good, bad = learner.read_trajectories("rank0", n, 100, CHECK)
    assert len(good) == n and bad == []
    learner.ack_trajectories([r for r, _ in good], finished=[t.traj_id for _, t in good])
    return [r for r, _ in good]


@pytest.mark.parametrize("keep_s, kept", [(0, 1), (3600, 10)])
def test_acknowledged_entries_are_trimmed_once_older_than_keep_acknowledged(
    redis_url, run_id, keep_s, kept
):
    learner = _learner(redis_url, run_id, keep_acknowledged_s=keep_s)
    gen = generator(redis_url, run_id)
    admit(learner, gen)
    _answer_all(learner, gen, 10)
    learner.maintain_now()
    r, k = redis.Redis.from_url(redis_url), RunKeys(run_id)
    # everything is acknowledged: all goes, but the last entry the learner group read (its
    # last-delivered id, the trim's MINID) and what is younger than keep_acknowledged_s
    assert r.xlen(k.trajectories("gen-0")) == kept
    assert r.xinfo_stream(k.trajectories("gen-0"))["entries-added"] == 10
    # the prompts are done with too: none in flight, all claimed, so only the last claimed stays
    assert r.hlen(k.inflight) == 0 and r.xlen(k.prompts) == 1
    # the learner's count of what it trimmed keeps the stream check exact (broker/channels/roster.py)
    assert r.hget(k.generators, "gen-0:trimmed") == str(10 - kept).encode()
    assert r.hget(k.generators, "gen-0") == b"active"
    learner.release()


def test_pending_entries_and_prompts_in_flight_are_never_trimmed(redis_url, run_id):
    learner = _learner(redis_url, run_id)
    gen = generator(redis_url, run_id)
    admit(learner, gen)
    works = [
        PromptWork(f"p{i}", f"g{i}", 1, 0, {"id": f"p{i}", "prompt": "1+1="}) for i in range(4)
    ]
    learner.add_prompts(works)
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    claimed = gen.claim_prompts(4, block_ms=100)
    for entry_id, w in claimed[:2]:
        t = Trajectory(
            w.group_id,
            w.prompt_id,
            w.group_id,
            "gen-0",
            0,
            0,
            np.array([1], np.int32),
            [s],
            mac=w.mac,
        )
        gen.add_trajectory(t, entry_id)
    good, _ = learner.read_trajectories("rank0", 10, 100, CHECK)  # pending: read, not trained
    learner.maintain_now()
    r, k = redis.Redis.from_url(redis_url), RunKeys(run_id)
    assert r.xlen(k.trajectories("gen-0")) == 2  # both pending in the learner group
    assert r.xlen(k.prompts) == 4  # two still claimed, two answered but still in flight
    learner.ack_trajectories([ref for ref, _ in good], finished=[t.traj_id for _, t in good])
    learner.maintain_now()
    # trained: the stream keeps its last delivered entry; the prompts stream keeps from the
    # oldest prompt still claimed (p2: p2 and p3 stay)
    assert r.xlen(k.trajectories("gen-0")) == 1 and r.xlen(k.prompts) == 2
    learner.release()


def test_dead_letters_keep_their_own_count_and_age(redis_url, run_id):
    learner = _learner(redis_url, run_id, dlq_retention=(3, 0.5))
    gen = generator(redis_url, run_id)
    admit(learner, gen)
    r, k = redis.Redis.from_url(redis_url), RunKeys(run_id)
    bad = [r.xadd(k.trajectories("gen-0"), {"schema": 2, "data": b"\xc1"}) for _ in range(5)]
    _, rejected = learner.read_trajectories("rank0", 10, 100, CHECK)
    assert len(rejected) == len(bad) and all(isinstance(x, Rejected) for x in rejected)
    learner.dead_letter(rejected)
    assert r.xlen(k.dlq) == 5
    learner.maintain_now()
    assert r.xlen(k.dlq) == 3  # redis.dlq_max_entries
    assert r.hget(k.dlq_reasons, "corrupt") == b"5"  # counted all the same
    time.sleep(1.0)  # the dead letters are now older than redis.dlq_max_age_s (0.5 s)
    learner.maintain_now()
    assert r.xlen(k.dlq) == 0
    learner.release()
