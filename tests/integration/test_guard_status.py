"""Guard warnings reach `rollctl status` through the run hash on a real redis-server."""

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.metrics.guards import GuardMonitor
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


def test_status_watch_redraws_the_compact_view(learner_broker, redis_url, run_id, capsys):
    from rollflash.rollctl.status import watch_status
    from tests.helpers.brokers import admit, generator

    cfg = config_from_dict({"run": {"run_id": run_id}, "redis": {"url": redis_url}})
    learner_broker.set_run_fields(state="training", step=3, reward_mean=0.5)
    g1 = generator(redis_url, run_id, "g1")
    admit(learner_broker, g1)
    g1.heartbeat(
        {
            "state": "sampling",
            "loaded_version": 2,
            "idle_frac": 0.25,
            "groups": 6,
            "heartbeat_at": 0,
        },
        ttl_s=30,
    )
    watch_status(cfg, interval_s=0.01, rounds=2)
    blocks = [b for b in capsys.readouterr().out.split("\n\n") if b.strip()]
    assert len(blocks) == 2  # not a terminal: one time-stamped block per round
    for block in blocks:
        lines = block.splitlines()
        assert lines[1] == f"run {run_id}  training  step 3/20  weights v-  heldout_acc -"
        assert lines[-1].startswith("  g1  sampling  v2  idle 0.25  groups 6  seen ")
