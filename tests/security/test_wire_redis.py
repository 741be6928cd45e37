"""A crafted trajectory entry on a real Redis: the learner's read dead-letters it with its reason
code and acknowledges it, so a restarted learner re-reading its own pending entries (what a resume
does) never meets it again."""

import msgpack
import numpy as np

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


def test_a_crafted_entry_is_dead_lettered_once_and_never_pending(broker):
    entry_id = broker.r.xadd(broker.trajectories, _crafted()).decode()
    good, bad = broker.read_trajectories("rank0", count=10, block_ms=100, vocab_size=10)
    assert good == [] and [b.entry_id for b in bad] == [entry_id]
    assert "shape" in bad[0].reason
    ((_, dead),) = broker.r.xrange(broker.dlq)
    assert dead[b"original_id"].decode() == entry_id and dead[b"code"] == b"bad_shape"
    again, rejected = broker.read_trajectories(
        "rank0", count=10, block_ms=0, vocab_size=10, own_pending=True
    )
    assert again == [] and rejected == []  # acknowledged with its dead letter
    assert broker.r.xpending(broker.trajectories, "learner")["pending"] == 0
