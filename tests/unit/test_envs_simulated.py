"""The simulated benchmark environment (envs/simulated.py): lengths, rewards, latency, determinism."""

import random
import threading
import time

import pytest

from rollflash.envs import make_task
from rollflash.envs.simulated import SimulatedEnv


def _play(env, seed):
    env.reset(seed)
    results = []
    while not results or not results[-1].done:
        results.append(env.step("anything"))
    return results


def test_episode_lengths_and_rewards():
    env = SimulatedEnv(min_turns=2, max_turns=4, step_latency_s=0.0, success_prob=0.5)
    lengths, finals = set(), []
    for seed in range(60):
        results = _play(env, seed)
        assert 2 <= len(results) <= 4 and all(r.reward == 0.0 for r in results[:-1])
        assert results[-1].reward == (1.0 if results[-1].info["success"] else 0.0)
        assert [r.observation for r in results[:-1]] == ["o" * 16] * (len(results) - 1)
        lengths.add(len(results))
        finals.append(results[-1].reward)
    assert lengths == {2, 3, 4} and 0 < sum(finals) < 60
    assert [r.reward for r in _play(env, 7)] == [r.reward for r in _play(env, 7)]


def test_steps_take_the_configured_time(monkeypatch):
    """Each step sleeps its drawn latency: recorded at `time.sleep` (which then sleeps), so the
    test checks the durations asked for, and the one bound the clock guarantees (a sleep lasts
    at least what was asked), never an upper bound a slow machine can miss."""
    asked: list[float] = []
    real_sleep, this_thread = time.sleep, threading.current_thread()

    def sleep(seconds: float) -> None:
        # only this thread's: a thread another test left in this worker (a Redis client's
        # reconnect backoff) sleeps through the same patched function
        if threading.current_thread() is this_thread:
            asked.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    env = SimulatedEnv(min_turns=3, max_turns=3, step_latency_s=0.05, latency_sigma=0.0)
    t0 = time.monotonic()
    _play(env, 1)
    assert time.monotonic() - t0 >= 0.15
    assert asked == [0.05] * 3  # three steps, lognormvariate(0, 0) = e^0 = 1 times 0.05 s
    # with a spread, the first step's latency is the episode's first draw, the same for a seed
    asked.clear()
    spread = SimulatedEnv(min_turns=3, max_turns=3, step_latency_s=0.05, latency_sigma=1.0)
    for seed in (7, 7, 8):
        _play(spread, seed)
    assert asked[0] == asked[3] == 0.05 * random.Random(7).lognormvariate(0.0, 1.0)
    assert asked[:3] == asked[3:6] != asked[6:]
    asked.clear()
    _play(SimulatedEnv(step_latency_s=0.0), 1)
    assert asked == []  # no latency, no sleep


def test_bad_parameters():
    with pytest.raises(ValueError, match="min_turns"):
        make_task("sim_env", {"min_turns": 5, "max_turns": 2})
    with pytest.raises(ValueError, match="success_prob"):
        make_task("sim_env", {"success_prob": 2})
