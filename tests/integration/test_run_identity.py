"""The run's identity (its config fingerprint, broker/channels/registry.py) on a real redis-server: a
learner that registered and failed before training leaves nothing the next learner's config must
match; the first learner that trains fixes it; generators follow."""

import threading

import pytest

from rollflash.broker.config.config import load_config
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.redis_io import RunMismatch
from rollflash.broker.sides.learner_side import LearnerBroker
from tests.helpers.brokers import generator


def _learner(url: str, run_id: str, cfg) -> LearnerBroker:
    b = LearnerBroker(connect(url, 5), run_id, 1000)
    b.take_lease()
    b.ensure_groups()
    b.register_run(cfg.fingerprint())
    return b


def test_a_failed_start_is_replaced_and_the_first_training_fixes_the_config(redis_url, run_id):
    typo = load_config(None, ["model.path=nope"])
    fixed = load_config(None, ["model.path=models/tiny"])
    failed = _learner(redis_url, run_id, typo)  # registered, then failed loading its model
    old = generator(redis_url, run_id, "gen-old")
    old._registry.join(typo.fingerprint(), timeout_s=5)  # the check of join_run
    failed.release()

    new = generator(redis_url, run_id, "gen-new")
    joined = threading.Event()
    waiter = threading.Thread(
        target=lambda: (new._registry.join(fixed.fingerprint(), timeout_s=120), joined.set())
    )
    waiter.start()  # another config, on a run that never trained: it waits, not refused
    learner = _learner(redis_url, run_id, fixed)  # replaces the failed start's config
    waiter.join(timeout=120)
    assert joined.is_set()
    with pytest.raises(
        RunMismatch, match=r'model.path \(the run: "models/tiny", this process: "nope"\)'
    ):
        old.run_state()  # the generator of the failed start stops at its next look

    learner.set_run_fields(state="training")  # the first step: the config is the run's now
    learner.release()
    with pytest.raises(RunMismatch, match="was started with another config"):
        _learner(redis_url, run_id, typo)
    late = generator(redis_url, run_id, "gen-late")
    with pytest.raises(RunMismatch, match="was started with another config"):
        late._registry.join(typo.fingerprint(), timeout_s=5)
