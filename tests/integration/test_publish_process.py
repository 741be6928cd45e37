"""learner/durability/publish_process.py (`trainer.background_publish: process`) with a real helper process
and a real redis-server:

- each version holds the weights of the step that published it, although the parameters change
  in place as soon as `publish` returns: the same bytes and digests as publishing in the step;
- versions are announced in order (the `weights` hash names the helper's zmq endpoint), and the
  learner keeps each announcement for the audit;
- a version the helper cannot write is never announced, and the learner hears of it (one line)
  at its next publish; a helper killed with SIGKILL is reported the same way."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rollflash.broker.config.config import load_config
from rollflash.broker.weights.weights import MODEL_FILE, WeightStore
from rollflash.learner.durability.publish import Publisher
from rollflash.learner.durability.publish_process import NewVersion, PublishFailed


def _publisher(tmp_path, redis_url, run_id, broker, mode) -> Publisher:
    cfg = load_config(
        None,
        [
            f"run.run_dir={tmp_path}",
            f"run.run_id={run_id}",
            f"redis.url={redis_url}",
            f"trainer.background_publish={mode}",
        ],
    )
    return Publisher(cfg, broker, resuming=False)


def _steps(publisher: Publisher, steps: int) -> None:
    """Publish versions 1..steps of a model whose parameters an optimiser changes in place
    right after each publish."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        publisher.publish(dict(model.state_dict()), NewVersion(step, step))
        with torch.no_grad():  # changed in place while the helper may still be writing
            for p in model.parameters():
                p.add_(1000.0)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1000.0)


def test_the_helper_publishes_what_the_step_publishes(tmp_path, redis_url, run_id, learner_broker):
    runs, endpoints = {}, {}
    for mode in ("false", "process"):
        learner_broker._registry.announced = None  # what this learner announced, or kept
        publisher = _publisher(tmp_path / mode, redis_url, run_id, learner_broker, mode)
        _steps(publisher, 3)
        publisher.close()
        store = WeightStore(tmp_path / mode)
        assert store.versions() == [1, 2, 3] and store.latest() == 3
        assert [store.open_version(v).manifest.kind for v in (1, 2, 3)] == ["full"] * 3
        runs[mode] = [(store.version_dir(v) / MODEL_FILE).read_bytes() for v in (1, 2, 3)]
        announced = learner_broker._registry.weights()
        assert announced["version"] == "3" and announced["path"] == str(store.version_dir(3))
        endpoints[mode] = announced["zmq_endpoint"]
    assert runs["process"] == runs["false"]  # the same bytes, so the same digests
    # the helper announced on its own socket, and the learner remembers its announcement
    assert endpoints["process"] != endpoints["false"]
    assert learner_broker._registry.announced["version"] == 3


def test_a_version_the_helper_cannot_write_is_reported_and_never_announced(
    tmp_path, redis_url, run_id, learner_broker
):
    publisher = _publisher(tmp_path, redis_url, run_id, learner_broker, "process")
    publisher.publish({"w": torch.zeros(4)}, NewVersion(1, 1))
    publisher.wait()
    WeightStore(tmp_path).version_dir(2).mkdir()  # v2's place is taken: its write fails
    publisher.publish({"w": torch.ones(4)}, NewVersion(2, 2))
    with pytest.raises(PublishFailed, match="v2: FileExistsError"):
        publisher.publish({"w": torch.ones(4)}, NewVersion(3, 3))
    assert learner_broker._registry.weights()["version"] == "1"
    publisher.publish(
        {"w": torch.ones(4)}, NewVersion(3, 3)
    )  # the helper goes on with the next version
    publisher.close()
    assert learner_broker._registry.weights()["version"] == "3"


def test_a_killed_helper_is_reported_at_the_next_publish(
    tmp_path, redis_url, run_id, learner_broker
):
    publisher = _publisher(tmp_path, redis_url, run_id, learner_broker, "process")
    publisher.publish({"w": torch.zeros(4)}, NewVersion(1, 1))
    publisher.wait()
    helper = publisher._process._proc
    os.kill(helper.pid, signal.SIGKILL)
    helper.join(30)
    with pytest.raises(PublishFailed, match="died"):
        publisher.publish({"w": torch.ones(4)}, NewVersion(2, 2))
        publisher.wait()
    publisher.close()
    assert learner_broker._registry.weights()["version"] == "1"


def test_the_step_copies_the_weights_once_straight_into_the_helpers_shared_memory(
    tmp_path, redis_url, run_id, learner_broker
):
    """`publish` hands `published_weights` the helper's buffers: every tensor is cast and copied
    into shared memory in one copy (float32 parameters, bfloat16 buffers), and `submit` sends
    them on as they are; the version holds the step's weights."""
    from rollflash.learner.models.lora import published_weights

    publisher = _publisher(tmp_path, redis_url, run_id, learner_broker, "process")
    model = torch.nn.Linear(3, 2)
    cfg = load_config(None)
    try:
        weights, _ = published_weights(model, cfg, torch.bfloat16, into=publisher.buffers())
        assert all(t.is_shared() and t.dtype == torch.bfloat16 for t in weights.values())
        layout = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
        again = publisher.buffers()(layout)  # the same layout: the same block, not allocated
        assert all(again[n].data_ptr() == t.data_ptr() for n, t in weights.items())
        publisher.publish(weights, NewVersion(1, 1))
        publisher.wait()
    finally:
        publisher.close()
    from rollflash.broker.weights.weight_chain import verified_tensors

    got = verified_tensors(WeightStore(tmp_path), 1)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(got[name], p.to(torch.bfloat16), atol=0, rtol=0)


def test_the_helpers_own_errors_reach_the_learner_as_themselves():
    """A RunLost or LeaseLost in the helper stops the learner with that error's one line (rollctl
    prints it as `rollctl: error: ...`, exit 2); any other failure arrives as its text."""
    import multiprocessing

    from rollflash.broker.channels.lease import LeaseLost
    from rollflash.broker.connect.redis_io import RunLost
    from rollflash.learner.durability.publish_process import _send_failure

    class Unpicklable(RunLost):
        def __init__(self, what, extra):
            super().__init__(what)
            self.extra = extra

    ours, theirs = multiprocessing.Pipe()
    _send_failure(theirs, 3, RunLost("Redis no longer holds run rl:t"))
    _send_failure(theirs, 4, LeaseLost("the lease of run rl:t is held by another learner"))
    _send_failure(theirs, 5, OSError("No space left on device"))
    _send_failure(theirs, 6, Unpicklable("Redis no longer holds run rl:u", lambda: 0))
    kind, value = ours.recv()
    assert kind == "failed" and type(value) is RunLost and str(value).startswith("Redis no longer")
    kind, value = ours.recv()
    assert kind == "failed" and type(value) is LeaseLost
    assert ours.recv() == ("error", "v5: OSError: No space left on device")
    assert ours.recv() == ("error", "v6: Unpicklable: Redis no longer holds run rl:u")
