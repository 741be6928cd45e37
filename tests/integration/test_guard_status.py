"""Guard warnings reach `rollctl status` through the run hash on a real redis-server."""

from rollflash.broker.config import config_from_dict
from rollflash.learner.guards import GuardMonitor
from rollflash.rollctl.status import collect_status, guard_line


def test_guard_warnings_and_stop_reach_rollctl_status(learner_broker, redis_url, run_id):
    cfg = config_from_dict(
        {
            "run": {"run_id": run_id},
            "redis": {"url": redis_url},
            "guards": {"stop_on_guard": True, "patience": 2},
        }
    )
    mon = GuardMonitor(cfg)
    hacked = {"guard/truncated_frac": 0.9, "guard/length_mean": 3.0}
    mon.after_step(hacked, 8, learner_broker)
    line = guard_line(collect_status(cfg)["learner"])
    assert line == "guards: WARNING length_at_limit: 90% of responses hit max_new_tokens (> 50%)"
    mon.after_step(hacked, 8, learner_broker)  # second step in a row: patience 2 reached
    assert guard_line(collect_status(cfg)["learner"]).endswith(
        "| stopped by guard: length_at_limit: 90% of responses hit max_new_tokens (> 50%)"
    )
    mon.after_step({"guard/truncated_frac": 0.0, "guard/length_mean": 3.0}, 8, learner_broker)
    assert guard_line(collect_status(cfg)["learner"]).startswith("guards: ok | stopped by guard")
