"""A crafted trajectory entry on a real Redis: the learner's read rejects it, and dead-lettering
it copies it with its reason code and acknowledges it, so a restarted learner re-reading its own
pending entries (what a resume does) never meets it again."""

import msgpack
import numpy as np
import redis

from rollflash.broker.connect.keys import LEARNER_GROUP, RunKeys
from rollflash.broker.wire.schema import Sample, Trajectory, encode_trajectory


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


def test_a_crafted_entry_is_dead_lettered_once_and_never_pending(
    learner_broker, generator_broker, redis_url, run_id
):
    r, keys, broker = redis.Redis.from_url(redis_url), RunKeys(run_id), learner_broker
    stream = keys.trajectories("gen-0")
    entry_id = r.xadd(stream, _crafted()).decode()
    check = (10, 1, 0)
    good, bad = broker.read_trajectories("rank0", 10, 100, check)
    assert good == [] and [b.ref for b in bad] == [f"gen-0/{entry_id}"]
    assert "shape" in bad[0].reason
    broker.dead_letter(bad)  # once the caller recorded it (learner/intake/collect.py)
    ((_, dead),) = r.xrange(keys.dlq)
    assert dead[b"original_id"].decode() == entry_id and dead[b"code"] == b"bad_shape"
    again, rejected = broker.read_trajectories("rank0", 10, None, check, after={})
    assert again == [] and rejected == []  # acknowledged with its dead letter
    assert r.xpending(stream, LEARNER_GROUP)["pending"] == 0
    assert r.hgetall(keys.dlq_reasons) == {b"bad_shape": b"1"}
