"""The episode runner (generators/episodes.py) with the simulated engine and scripted environments:
episodes run without a barrier, groups are streamed as soon as they complete, redundant episodes
keep the first n to finish, and the sequences carry the right masks and turn records."""

import itertools
import threading

import numpy as np
import pytest

from rollflash.broker.config.config import SimConfig
from rollflash.broker.wire.schema import PromptWork
from rollflash.envs.multiturn import StepResult, TurnLimit
from rollflash.generators.episodes import EpisodeRunner, GroupSpec, episodes_to_trajectory
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine


class ScriptedEnv(TurnLimit):
    """Ends after `turns` turns (success); every step first calls `hold(instance)`, which returns
    at once for a fast environment and blocks on a `Gate` for a slow one."""

    counter = itertools.count()

    def __init__(self, turns: int, hold=lambda instance: None) -> None:
        self.max_turns, self.turns_needed, self.hold = 10, turns, hold
        self.instance = next(self.counter)

    def reset(self, seed: int) -> str:
        self._start()
        return f"start{seed}"

    def step(self, action: str) -> StepResult:
        self.hold(self.instance)
        done = self.turns + 1 >= self.turns_needed
        return self._finish(f"obs{self.turns}", 1.0 if done else 0.25, done, success=done)


class Gate:
    """A slow environment's steps block here until the test opens the gate, so that what the
    tests check is an order of events, not a duration. A step that gives up waiting (after
    `timeout_s`, far beyond any run's length) is counted: it means the runner waited for the slow
    environment, which is what the tests rule out."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.opened, self.timeout_s, self.timed_out = threading.Event(), timeout_s, 0

    def __call__(self, instance: int) -> None:
        if not self.opened.wait(self.timeout_s):
            self.timed_out += 1

    def open(self) -> None:
        self.opened.set()


def _episode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("episode-")]


def _runner(max_tokens=1000) -> EpisodeRunner:
    engine = SimEngine(SimConfig(per_token_s=0.001, length_median=3, length_sigma=0.3), seed=0)
    engine.version = 7  # as after load_weights(..., 7); the engine stamps its tokens with it
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4)
    return EpisodeRunner(engine, params, max_tokens, version=lambda: 7)


def test_a_slow_environment_does_not_hold_back_other_groups():
    """Group 0's environment blocks at its first step until group 1 has been streamed; with a
    per-turn barrier group 1 could not finish first, and group 0's gate would time out."""
    gate, done = Gate(), []

    def on_group(g, eps):
        done.append((g, gate.opened.is_set()))
        if g == 1:
            gate.open()

    specs = [
        GroupSpec(lambda: ScriptedEnv(3, gate), seed=1, keep=2, start=2),
        GroupSpec(lambda: ScriptedEnv(3), seed=2, keep=2, start=2),
    ]
    _runner().run(specs, on_group)
    # group 1 streamed while group 0 was still blocked; group 0 only after the gate opened
    assert done == [(1, False), (0, True)]
    assert gate.timed_out == 0


def test_redundant_episodes_keep_the_first_to_finish():
    """Instances 0 and 2 block in their first step; 1 and 3 finish. The run returns with 1 and 3
    while 0 and 2 are still blocked, and those exit at their next turn once released."""
    ScriptedEnv.counter = itertools.count()
    gate, kept = Gate(), {}

    def hold(instance):
        if instance in (0, 2):
            gate(instance)

    spec = GroupSpec(lambda: ScriptedEnv(2, hold), seed=5, keep=2, start=4)
    _runner().run([spec], lambda g, eps: kept.setdefault(g, [e.env.instance for e in eps]))
    assert sorted(kept[0]) == [1, 3]
    # run() returned without waiting for the cancelled slow ones: they are still in the gate
    assert not gate.opened.is_set() and gate.timed_out == 0
    gate.open()  # they finish their current step, see the cancel and exit
    for t in _episode_threads():
        t.join(timeout=60)
    assert _episode_threads() == [] and gate.timed_out == 0


def test_episode_sequences_and_trajectory_fields():
    got = {}
    spec = GroupSpec(lambda: ScriptedEnv(3), seed=9, keep=2, start=2)
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
    spec = GroupSpec(lambda: ScriptedEnv(50), seed=1, keep=1, start=1)
    _runner(max_tokens=30).run([spec], lambda g, eps: got.setdefault(g, eps))
    ep = got[0][0]
    assert ep.truncated and not ep.success and len(ep.response_ids) + 4 > 30


def test_an_environment_exception_ends_its_episode_and_is_counted():
    class Broken(ScriptedEnv):
        def step(self, action):
            raise KeyError("bug")

    got = {}
    spec = GroupSpec(lambda: Broken(2), seed=1, keep=1, start=2)
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
    slow group of the first pull is still running (blocked in its environment until the last
    refilled group has been streamed)."""
    gate, done, calls = Gate(), [], []
    specs = [
        GroupSpec(lambda: ScriptedEnv(3, gate), seed=1, keep=1, start=1),
        GroupSpec(lambda: ScriptedEnv(2), seed=2, keep=1, start=1),
    ]

    def on_group(g, eps):
        done.append((g, gate.opened.is_set()))
        if g == 3:
            gate.open()

    def refill():
        calls.append(gate.opened.is_set())
        n = len(calls)
        return [GroupSpec(lambda: ScriptedEnv(2), seed=10 + n, keep=1, start=1)] if n <= 2 else []

    _runner().run(specs, on_group, refill=refill)
    # groups 2 and 3 came from refills, started and finished while the slow group 0 was blocked
    assert done == [(1, False), (2, False), (3, False), (0, True)]
    # the refills that started groups 2 and 3 ran while group 0 was blocked
    assert calls[:2] == [False, False] and gate.timed_out == 0
