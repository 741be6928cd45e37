"""A crafted trajectory entry on a real Redis: the learner's read dead-letters it with its reason
code and acknowledges it, so a restarted learner re-reading its own pending entries (what a resume
does) never meets it again."""

import msgpack
import numpy as np
import redis

from rollflash.broker.keys import LEARNER_GROUP, RunKeys
from rollflash.broker.schema import Sample, Trajectory, encode_trajectory


def _crafted() -> dict:
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    fields = encode_trajectory(
        Trajectory("g", "p", "g", "evil", 0, 0, np.array([1], np.int32), [s])
    )
    body = msgpack.unpackb(fields["data"])
    body["prompt_ids"] = {"dtype": "<i4", "shape": [2**62, 0], "data": b""}
    return {**fields, "data": msgpack.packb(body)}


def test_a_crafted_entry_is_dead_lettered_once_and_never_pending(learner_broker, redis_url, run_id):
    r, keys, broker = redis.Redis.from_url(redis_url), RunKeys(run_id), learner_broker
    entry_id = r.xadd(keys.trajectories, _crafted()).decode()
    good, bad = broker.read_trajectories("rank0", count=10, block_ms=100, vocab_size=10)
    assert good == [] and [b.entry_id for b in bad] == [entry_id]
    assert "shape" in bad[0].reason
    ((_, dead),) = r.xrange(keys.dlq)
    assert dead[b"original_id"].decode() == entry_id and dead[b"code"] == b"bad_shape"
    again, rejected = broker.read_trajectories(
        "rank0", count=10, block_ms=0, vocab_size=10, own_pending=True
    )
    assert again == [] and rejected == []  # acknowledged with its dead letter
    assert r.xpending(keys.trajectories, LEARNER_GROUP)["pending"] == 0
    assert r.hgetall(keys.dlq_reasons) == {b"bad_shape": b"1"}
