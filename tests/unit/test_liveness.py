"""A generator's heartbeat TTL and reclaim time scale with the measured pace of the run
(generators/liveness.py), hand-worked with a fake clock: the configured values are floors, the
75th percentiles of the last turns, learner steps and holds raise them, and one long outlier
(a process stopped for a while) does not."""

from rollflash.broker.config.config import load_config
from rollflash.generators.liveness import Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _liveness(**rollout) -> tuple[Liveness, Clock]:
    clock = Clock()
    cfg = load_config(None, [f"rollout.{k}={v}" for k, v in rollout.items()])
    return Liveness(cfg.rollout, clock), clock


def test_nothing_measured_keeps_the_configured_times():
    live, _ = _liveness(heartbeat_ttl_s=30, reclaim_idle_s=120)
    live.beat(0)
    assert (live.heartbeat_ttl_s, live.reclaim_idle_s, live.step_s) == (30, 120, 0)


def test_minute_long_steps_raise_both_times():
    live, clock = _liveness(heartbeat_ttl_s=30, reclaim_idle_s=120)
    # beats every 100 s; version 1 first seen at 200 s, version 3 at 400 s
    for t, v in ((0, 0), (100, 0), (200, 1), (300, 1), (400, 3)):
        clock.now = t
        live.beat(v)
        live.held(90)
    # turns [100] x 4 -> 100; steps: (200 - 0) / 1 = 200, (400 - 200) / 2 = 100 -> p75 = 200
    assert live.step_s == 200
    assert live.heartbeat_ttl_s == 3 * 100
    # reclaim: 3 x max(hold 90, step 200 + turn 100) = 900
    assert live.reclaim_idle_s == 900


def test_one_long_stop_does_not_count():
    live, clock = _liveness(heartbeat_ttl_s=30, reclaim_idle_s=120)
    live.beat(0)
    for i in range(1, 16):  # 15 turns of 2 s
        clock.now = 2.0 * i
        live.beat(0)
    clock.now += 600  # stopped for 10 minutes
    live.beat(0)
    # turns: 15 x 2 s and one of 600 s; the 75th percentile (12th of 16) is 2 s
    assert live.heartbeat_ttl_s == 30 and live.reclaim_idle_s == 120
