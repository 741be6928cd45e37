"""`rollctl status --watch`'s compact view, from a hand-built status."""

from rollflash.rollctl.status import compact_lines

STATUS = {
    "run": "demo",
    "learner": {
        "state": "training",
        "step": "37",
        "reward_mean": "0.61",
        "staleness_max": "1",
        "wait_frac": "0.12",
        "samples_per_s": "41.3",
        "heldout_acc": "0.55",
        "guard_warnings": "none",
    },
    "weights": {"version": "37"},
    "streams": {
        "prompts": {"length": 24, "groups": [{"group": "gen", "pending": 8, "lag": 16}]},
        "trajectories": {"length": 3, "groups": [{"group": "learner", "pending": 1, "lag": 2}]},
        "dlq": {"length": 2, "groups": []},
    },
    "generators": {
        "gen-a": {"state": "sampling", "loaded_version": "37", "idle_frac": "0.08", "groups": "120",
                  "last_seen_s": 0.4},
        "gen-b": {"state": "loading", "loaded_version": "36", "idle_frac": "0.31", "groups": "97",
                  "last_seen_s": 1.2},
    },
    "dead_letters": {"bad_token": 1, "too_large": 1},
}  # fmt: skip


def test_compact_view_has_learner_queues_dead_letters_guards_and_each_generator():
    lines = compact_lines(STATUS, total_steps=150)
    assert lines == [
        "run demo  training  step 37/150  weights v37  heldout_acc 0.55",
        "learner  reward 0.61  staleness_max 1  wait 0.12  samples/s 41.3  ranks 1  checkpoint -",
        "queues   prompts=24 (gen: pending=8 lag=16)  trajectories=3 (learner: pending=1 lag=2)",
        "dead letters: 2 (bad_token=1, too_large=1)",
        "guards: ok",
        "generators: 2 alive",
        "  gen-a  sampling  v37  idle 0.08  groups 120  seen 0.4s ago",
        "  gen-b  loading  v36  idle 0.31  groups 97  seen 1.2s ago",
    ]


def test_compact_view_of_a_run_not_started():
    empty = {**STATUS, "learner": {}, "weights": {}, "generators": {}, "dead_letters": {}}
    lines = compact_lines(empty, total_steps=20)
    assert lines[0] == "run demo  not started  step 0/20  weights v-  heldout_acc -"
    assert lines[3:] == ["dead letters: 0", "guards: no step yet", "generators: 0 alive"]


def test_a_joining_generator_shows_no_nones():
    """Its first heartbeat holds its state alone: no version loaded, no counters yet."""
    from rollflash.rollctl.status import generator_line

    joining = {"state": "up", "heartbeat_at": "1718000000.0", "last_seen_s": 0.3}
    status = {**STATUS, "generators": {"gen-c": joining}}
    assert compact_lines(status, total_steps=150)[-1] == "  gen-c  joining  seen 0.3s ago"
    line = generator_line("gen-c", joining)
    assert (
        line == "generator gen-c: joining (asked to join, no version loaded yet) last_seen=0.3s ago"
    )
    first = {"state": "up", "loaded_version": "0", "last_seen_s": 1.0}  # admitted, nothing done
    assert "None" not in generator_line("gen-c", first)
    assert "None" not in compact_lines({**STATUS, "generators": {"gen-c": first}}, 150)[-1]


def test_the_lag_a_finished_run_leaves_is_explained():
    """Prompts issued and groups generated ahead (async_ratio) for steps the run did not take
    stay unread when it ends; while it trains, lag is only a number."""
    done = {**STATUS, "learner": {**STATUS["learner"], "state": "done"}}
    queues = compact_lines(done, total_steps=37)[2]
    assert queues == (
        "queues   prompts=24 (gen: pending=8 lag=16 (prompts issued ahead for steps the run did "
        "not take; a longer or resumed run uses them))  trajectories=3 (learner: pending=1 "
        "lag=2 (groups generated ahead for steps the run did not take; a longer or resumed run "
        "uses them))"
    )
    assert "run did not take" not in compact_lines(STATUS, total_steps=150)[2]
    unknown = {"group": "learner", "pending": 0, "lag": None}
    from rollflash.rollctl.status import lag_text

    assert lag_text(unknown, "done") == "lag=?"
