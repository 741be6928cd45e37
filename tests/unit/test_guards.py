"""Reward-hacking guards (learner/metrics/guards.py): the statistics by hand, the thresholds, the stop
after `patience` steps, the adaptive KL state, and quiet on a healthy batch."""

import numpy as np
import pytest

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.metrics.guards import (
    GuardMonitor,
    evaluate_guards,
    guard_values,
    kl_rise,
    ngram_repeat_frac,
    score_std,
)


def _group(responses, rewards, finished=None) -> Trajectory:
    finished = finished or [True] * len(responses)
    samples = [
        Sample(
            response_ids=np.asarray(r, dtype=np.int32),
            logprobs=np.zeros(len(r), dtype=np.float32),
            token_versions=np.zeros(len(r), dtype=np.int32),
            reward=w,
            finished=f,
        )
        for r, w, f in zip(responses, rewards, finished)
    ]
    return Trajectory(
        traj_id="g",
        prompt_id="p",
        group_id="g",
        generator="x",
        behavior_version=0,
        issued_version=0,
        prompt_ids=np.asarray([1, 2], dtype=np.int32),
        samples=samples,
    )


def test_statistics_by_hand():
    assert ngram_repeat_frac([1, 1, 1, 1], 2) == pytest.approx(2 / 3)  # (1,1) x3, two repeats
    assert ngram_repeat_frac([5, 6, 7, 5, 6, 7], 3) == pytest.approx(1 / 4)  # 4 trigrams, 1 repeat
    assert ngram_repeat_frac([1, 2], 3) == 0.0  # no trigram at all
    assert score_std([1.0, 3.0]) == pytest.approx(1.0)  # population std: |1 - 2| = 1
    assert score_std([2.0]) == 0.0
    assert kl_rise([0.3, 0.1, 0.2, 0.9]) == pytest.approx(0.8)  # 0.9 - min(0.3, 0.1, 0.2)
    assert kl_rise([0.5]) == 0.0
    # with a KL target, the climb from the reference (KL 0) up to it is not a rise
    assert kl_rise([0.0, 0.1, 0.3, 0.6], floor=0.2) == pytest.approx(0.4)
    assert kl_rise([0.3, 0.25, 0.9], floor=0.2) == pytest.approx(0.65)  # the minimum is above it


def test_guard_values_of_a_batch():
    # lengths 3, 2, 4, 1 -> mean 2.5; one of four truncated; [7,7,7,7] has 2 repeated bigrams of 3
    g = _group(
        [[4, 5, 2], [6, 2], [7, 7, 7, 7], [2]],
        [1.0, 0.0, 1.0, 0.0],
        finished=[True, True, False, True],
    )
    v = guard_values([g], ngram_n=2)
    assert v["guard/length_mean"] == 2.5
    assert v["guard/truncated_frac"] == 0.25
    assert v["guard/score_std"] == pytest.approx(0.5)
    assert v["guard/ngram_repeat"] == pytest.approx((0 + 0 + 2 / 3 + 0) / 4)


def _cfg(**guards):
    return config_from_dict({"guards": guards, "reward": {"type": "model", "model_path": "rm"}})


def test_the_climb_to_the_kl_target_is_not_a_rise():
    """KL 0 -> 0.6 in four steps (kl_max_rise 0.5): a rise without a target; with an adaptive
    controller aiming at 0.2 it is 0.4 above the target, and 0.9 would be 0.7."""
    g = _cfg().guards

    def fired(history, target):
        return [r.fired for r in evaluate_guards({}, history, g, False, kl_target=target)]

    assert fired([0.0, 0.1, 0.3, 0.6], None) == [True]
    assert fired([0.0, 0.1, 0.3, 0.6], 0.2) == [False]
    assert fired([0.0, 0.1, 0.3, 0.9], 0.2) == [True]


def test_thresholds_fire_and_stay_quiet():
    g = _cfg().guards
    healthy = {
        "guard/score_std": 0.8,
        "guard/length_mean": 3.2,
        "guard/truncated_frac": 0.02,
        "guard/ngram_repeat": 0.0,
    }
    assert not any(r.fired for r in evaluate_guards(healthy, [0.01, 0.02, 0.03], g, True))
    hacked = {
        "guard/score_std": 1e-5,
        "guard/length_mean": 1.0,
        "guard/truncated_frac": 0.9,
        "guard/ngram_repeat": 0.6,
    }
    fired = {r.name for r in evaluate_guards(hacked, [0.01, 0.02, 1.5], g, True) if r.fired}
    assert fired == {
        "kl_rise",
        "score_collapse",
        "length_collapse",
        "length_at_limit",
        "repeated_ngrams",
    }
    # relative collapse: std 0.1 is above the absolute floor 1e-3 but below 5% of a first std of 4
    rel = {
        r.name: r
        for r in evaluate_guards(
            dict(healthy, **{"guard/score_std": 0.1}), [], g, True, first_score_std=4.0
        )
    }
    assert rel["score_collapse"].fired and "< 0.2" in rel["score_collapse"].message
    assert not evaluate_guards(dict(healthy, **{"guard/score_std": 0.3}), [], g, True, 4.0)[0].fired
    # a verifier's equal rewards (every sample right) are not a collapse
    assert not [
        r for r in evaluate_guards(hacked, [], g, False) if r.name == "score_collapse" and r.fired
    ]


def test_stop_after_patience_and_kl_state():
    cfg = _cfg(stop_on_guard=True, patience=2)
    mon = GuardMonitor(cfg)
    bad = {
        "guard/score_std": 0.5,
        "guard/length_mean": 3.0,
        "guard/truncated_frac": 0.95,
        "guard/ngram_repeat": 0.0,
    }
    good = dict(bad, **{"guard/truncated_frac": 0.0})
    out = mon.after_step(bad, 64)
    assert out["guard/fired_length_at_limit"] == 1.0 and out["guard/fired"] == 1.0
    assert not mon.stop_requested  # 1 of 2 steps
    mon.after_step(good, 64)  # streak broken
    mon.after_step(bad, 64)
    assert not mon.stop_requested
    mon.after_step(bad, 64)
    assert mon.stop_requested and mon.stop_reason.startswith("length_at_limit")


def test_no_stop_without_stop_on_guard_and_disabled_guards_report_nothing():
    mon = GuardMonitor(_cfg(patience=1))
    for _ in range(3):
        mon.after_step({"guard/truncated_frac": 1.0}, 8)
    assert not mon.stop_requested
    assert GuardMonitor(_cfg(enabled=False)).after_step({"guard/truncated_frac": 1.0}, 8) == {}


def test_adaptive_kl_coef_moves_and_reaches_the_step_config():
    cfg = config_from_dict({"algo": {"kl_coef": 0.1, "kl_target": 0.05, "kl_horizon": 1000}})
    mon = GuardMonitor(cfg)
    assert mon.step_config(cfg).algo.kl_coef == 0.1
    out = mon.after_step({"kl/behav_ref_kl": 0.5}, 100)  # e clipped to 0.2: x (1 + 0.2 * 0.1)
    assert out["kl/coef"] == 0.1  # the coefficient the step trained with
    assert mon.kl_coef == pytest.approx(0.102)
    assert mon.step_config(cfg).algo.kl_coef == pytest.approx(0.102)
    assert cfg.algo.kl_coef == 0.1  # the loaded config is not mutated
    fixed = config_from_dict({"algo": {"kl_coef": 0.1}})
    assert GuardMonitor(fixed).step_config(fixed) is fixed


def test_state_round_trips_through_json_and_resumes_the_streak():
    import json

    cfg = config_from_dict(
        {
            "algo": {"kl_coef": 0.1, "kl_target": 0.05, "kl_horizon": 1000},
            "guards": {"stop_on_guard": True, "patience": 2},
        }
    )
    bad = {"guard/truncated_frac": 0.95, "guard/score_std": 0.5, "kl/behav_ref_kl": 0.5}
    mon = GuardMonitor(cfg)
    mon.after_step(bad, 100)  # streak 1 of 2; kl_coef 0.1 -> 0.102
    saved = json.loads(json.dumps(mon.state_dict()))  # what state.json holds
    assert saved == {
        "kl_coef": pytest.approx(0.102),
        "kl_history": [0.5],
        # only the guards whose metric the step has: kl, score std (a rule reward: never fires)
        "streaks": {"kl_rise": 0, "score_collapse": 0, "length_at_limit": 1},
        "first_score_std": 0.5,
    }
    resumed = GuardMonitor(cfg)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == mon.state_dict()
    resumed.after_step(bad, 100)  # streak 2 of 2: stops, as the uninterrupted monitor would
    mon.after_step(bad, 100)
    assert resumed.stop_requested and mon.stop_requested
    assert resumed.state_dict() == mon.state_dict()


def test_guard_state_with_a_missing_or_unknown_key_is_refused():
    cfg = config_from_dict({"algo": {"kl_coef": 0.1}})
    mon = GuardMonitor(cfg)
    saved = mon.state_dict()
    with pytest.raises(ValueError, match="keys \\['kl_coeff'\\], expected"):
        mon.load_state_dict({"kl_coeff": 0.2})
    with pytest.raises(ValueError, match="expected \\['first_score_std', 'kl_coef'"):
        mon.load_state_dict({k: v for k, v in saved.items() if k != "streaks"})
    assert mon.state_dict() == saved  # nothing was changed by a refused state


def test_status_line_shows_the_last_warnings():
    from rollflash.rollctl.status import guard_line

    assert guard_line({}) == "guards: no step yet"
    assert guard_line({"guard_warnings": "none", "guard_stop": ""}) == "guards: ok"
    line = guard_line(
        {
            "guard_warnings": "length_at_limit: 90% of responses hit max_new_tokens",
            "guard_stop": "length_at_limit: 90% of responses hit max_new_tokens",
        }
    )
    assert line.startswith("guards: WARNING length_at_limit: 90%") and "| stopped by guard:" in line
