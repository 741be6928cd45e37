"""The episode runner (generators/episodes.py) with the simulated engine and scripted environments:
episodes run without a barrier, groups are streamed as soon as they complete, redundant episodes
keep the first n to finish, and the sequences carry the right masks and turn records."""

import itertools
import threading
import time

import numpy as np
import pytest

from rollflash.broker.config import SimConfig
from rollflash.broker.schema import PromptWork
from rollflash.envs.multiturn import StepResult, TurnLimit
from rollflash.generators.episodes import EpisodeRunner, GroupSpec, episodes_to_trajectory
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine


class ScriptedEnv(TurnLimit):
    """Ends after `turns` turns (success); every step sleeps `latency(instance)` seconds."""

    counter = itertools.count()

    def __init__(self, turns: int, latency) -> None:
        self.max_turns, self.turns_needed, self.latency = 10, turns, latency
        self.instance = next(self.counter)

    def reset(self, seed: int) -> str:
        self._start()
        return f"start{seed}"

    def step(self, action: str) -> StepResult:
        time.sleep(self.latency(self.instance))
        done = self.turns + 1 >= self.turns_needed
        return self._finish(f"obs{self.turns}", 1.0 if done else 0.25, done, success=done)


def _runner(max_tokens=1000) -> EpisodeRunner:
    engine = SimEngine(SimConfig(per_token_s=0.001, length_median=3, length_sigma=0.3), seed=0)
    engine.version = 7  # as after load_weights(..., 7); the engine stamps its tokens with it
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4)
    return EpisodeRunner(engine, params, max_tokens, version=lambda: 7)


def test_a_slow_environment_does_not_hold_back_other_groups():
    done_at = {}
    started = time.monotonic()
    specs = [
        GroupSpec(lambda: ScriptedEnv(3, lambda i: 0.6), seed=1, keep=2, start=2),
        GroupSpec(lambda: ScriptedEnv(3, lambda i: 0.0), seed=2, keep=2, start=2),
    ]
    _runner().run(specs, lambda g, eps: done_at.setdefault(g, time.monotonic() - started))
    # group 1 needs 3 fast turns; group 0 three 0.6 s steps (>= 1.8 s). With a per-turn barrier
    # group 1 would also take >= 1.8 s.
    assert list(done_at) == [1, 0]
    assert done_at[1] < 1.0 and done_at[0] >= 1.8


def test_redundant_episodes_keep_the_first_to_finish():
    ScriptedEnv.counter = itertools.count()
    slow = {0: 1.0, 2: 1.0}  # instances 0 and 2 are slow (2 s per episode); 1 and 3 fast
    kept = {}
    spec = GroupSpec(lambda: ScriptedEnv(2, lambda i: slow.get(i, 0.0)), seed=5, keep=2, start=4)
    t0 = time.monotonic()
    _runner().run([spec], lambda g, eps: kept.setdefault(g, [e.env.instance for e in eps]))
    assert sorted(kept[0]) == [1, 3]
    assert time.monotonic() - t0 < 1.5  # returned without waiting for the cancelled slow ones
    time.sleep(1.5)  # the slow ones finish their current step, see the cancel and exit
    assert not [t for t in threading.enumerate() if t.name.startswith("episode-")]


def test_episode_sequences_and_trajectory_fields():
    got = {}
    spec = GroupSpec(lambda: ScriptedEnv(3, lambda i: 0.0), seed=9, keep=2, start=2)
    _runner().run([spec], lambda g, eps: got.setdefault(g, eps))
    episodes = got[0]
    for ep in episodes:
        assert ep.done and ep.success and not ep.truncated and len(ep.turn_starts) == 3
        assert ep.turn_rewards == [0.25, 0.25, 1.0] and ep.reward == 1.5
        mask = np.array(ep.loss_mask)
        # observation "obs0" / "obs1" (4 simulated tokens each) follow turns 0 and 1, none after 2
        assert (mask == 0).sum() == 8 and mask[-1] == 1
        assert all(mask[s] == 1 for s in ep.turn_starts)
        assert set(ep.versions) == {7}
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, mask) if m == 0)
    work = PromptWork("p1", "g1", 2, 3, {"prompt": "start9", "answer": "9", "id": "p1"})
    traj = episodes_to_trajectory(work, episodes, "gen-x")
    assert traj.behavior_version == 7 and traj.samples[0].reward == 1.5
    assert traj.samples[0].turn_states[0] != traj.samples[0].turn_states[1]
    # every episode of a group starts in the same state
    assert len({s.turn_states[0] for s in traj.samples}) == 1


def test_token_budget_truncates_an_episode():
    got = {}
    spec = GroupSpec(lambda: ScriptedEnv(50, lambda i: 0.0), seed=1, keep=1, start=1)
    _runner(max_tokens=30).run([spec], lambda g, eps: got.setdefault(g, eps))
    ep = got[0][0]
    assert ep.truncated and not ep.success and len(ep.response_ids) + 4 > 30


def test_an_environment_exception_ends_its_episode_and_is_counted():
    class Broken(ScriptedEnv):
        def step(self, action):
            raise KeyError("bug")

    got = {}
    spec = GroupSpec(lambda: Broken(2, lambda i: 0.0), seed=1, keep=1, start=2)
    _runner().run([spec], lambda g, eps: got.setdefault(g, eps))
    ep = got[0][0]  # the group is streamed: its episode ended cleanly at the raising step
    assert ep.done and ep.truncated and ep.turn_rewards == [0.0] and ep.env_errors == 1


def test_an_environment_that_cannot_be_built_is_raised_not_swallowed():
    def make_env():
        raise ValueError("bad parameter")

    spec = GroupSpec(make_env, seed=1, keep=1, start=2)
    with pytest.raises(RuntimeError, match="environment failed in episode seed 1"):
        _runner().run([spec], lambda g, eps: None)


def test_refill_starts_new_groups_while_others_still_run():
    """No barrier between pulls: a group streamed early makes room for a new one at once, while a
    slow group of the first pull is still running."""
    done_at, calls = {}, []
    started = time.monotonic()
    fast = lambda: ScriptedEnv(2, lambda i: 0.0)  # noqa: E731
    specs = [
        GroupSpec(lambda: ScriptedEnv(3, lambda i: 0.6), seed=1, keep=1, start=1),
        GroupSpec(fast, seed=2, keep=1, start=1),
    ]

    def refill():
        calls.append(time.monotonic() - started)
        return [GroupSpec(fast, seed=10 + len(calls), keep=1, start=1)] if len(calls) <= 2 else []

    _runner().run(
        specs, lambda g, eps: done_at.setdefault(g, time.monotonic() - started), refill=refill
    )
    # groups 2 and 3 came from refills and finished before the slow group 0 (>= 1.8 s)
    assert set(done_at) == {0, 1, 2, 3}
    assert done_at[2] < done_at[0] and done_at[3] < done_at[0] and done_at[0] >= 1.8
    assert calls[0] < 1.0
