"""The learner's check of the generators' probes (broker/channels/serving.py) on a real redis-server: what
each generator wrote in its own status hash, with its own client, judged by rank 0's broker."""

from __future__ import annotations

import pytest
import torch

from rollflash.broker.channels.roster import statuses
from rollflash.broker.channels.serving import ServingCheck
from rollflash.broker.weights.probe import PROBE_TOKENS, Report, probe_fields
from tests.helpers.brokers import admit, generator

pytestmark = pytest.mark.serves_wrong_weights  # tests/conftest.py

N = PROBE_TOKENS - 1


def _report(g, version: int, value: float, dtype: str = "float32") -> None:
    g.advertise(probe_fields(version, [value] * N, dtype))


def test_reports_are_judged_once_and_only_against_versions_the_learner_probed(
    learner_broker, redis_url, run_id
):
    honest, liar, garbled = (generator(redis_url, run_id, g) for g in ("honest", "liar", "garbled"))
    admit(learner_broker, honest, liar, garbled)
    check = ServingCheck(learner_broker.io, learner_broker.roster, None)
    check.record(3, [-2.0] * N, "float32")
    check.record(4, [-2.1] * N, "float32")
    _report(honest, 3, -2.0)
    _report(liar, 2, -5.0)  # a version the learner never probed (before it started): not judged
    _report(garbled, 3, -2.0)
    assert check.check() == [] and check.checked == 2
    _report(honest, 4, -2.1)
    _report(liar, 4, -2.0)  # 0.1 nats from v4's probe, 1e-3 allowed (float32 on both sides)
    garbled.advertise({"probe": "a,b"})
    assert sorted(check.check()) == ["garbled", "liar"] and check.checked == 4  # + honest, liar
    every = statuses(learner_broker.io)
    assert every["honest"] == "active"
    assert every["liar"].startswith("quarantined weights: its probe of v4 is 0.1 nats")
    assert every["garbled"].startswith("quarantined weights: an unreadable probe")
    assert check.check() == [] and check.checked == 4  # nothing new from honest: judged once


def test_a_skip_is_caught_at_its_first_report_when_the_learner_never_read_the_one_before(
    learner_broker, redis_url, run_id
):
    g = generator(redis_url, run_id, "skipper")
    admit(learner_broker, g)
    check = ServingCheck(learner_broker.io, learner_broker.roster, None)
    for version, value in ((1, -2.0), (2, -2.00002), (3, -2.00004)):  # moved 2e-5 per version
        check.record(version, [value] * N, "float32")
    # it reported v1 and then v3 with v1's values between two checks: the learner reads only
    # the v3 report, which is within the tolerance of v3's probe (2e-5 < 1e-3) and names the
    # v1 report as the one before it, bit for bit the same while the learner's moved 4e-5
    # (above a hundredth of the tolerance, 1e-5)
    g.advertise(probe_fields(3, [-2.0] * N, "float32", Report(1, (-2.0,) * N, "float32")))
    assert check.check() == ["skipper"]
    why = statuses(learner_broker.io)["skipper"]
    assert why.startswith("quarantined weights: its probe of v3 is bit for bit its probe of v1")


def test_the_tolerance_and_the_switch(learner_broker, redis_url, run_id, tmp_path):
    from rollflash.broker.config.config import load_config
    from rollflash.learner.durability.publish import Publisher
    from rollflash.learner.durability.publish_process import NewVersion

    g = generator(redis_url, run_id, "far")
    admit(learner_broker, g)
    loose = ServingCheck(
        learner_broker.io, learner_broker.roster, 0.2
    )  # weights.probe_tolerance: 0.1 off is within
    loose.record(4, [-2.1] * N, "float32")
    _report(g, 4, -2.0)
    assert loose.check() == []
    # weights.probe: false: the learner records no probe and judges nothing, at a publish or
    # at a watch
    off = ["weights.probe=false", "trainer.background_publish=false"]
    cfg = load_config(None, [f"run.run_dir={tmp_path}", *off])
    publisher = Publisher(cfg, learner_broker, resuming=False)
    assert publisher.serving is None and learner_broker.serving is None
    publisher.publish({"w": torch.zeros(4)}, NewVersion(5, 5), probe=([-2.1] * N, "float32"))
    _report(g, 5, -9.0)
    learner_broker.maintain_now()
    publisher.publish({"w": torch.ones(4)}, NewVersion(6, 6))
    assert statuses(learner_broker.io)["far"] == "active"
    publisher.close()
