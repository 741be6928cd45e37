"""Grid world dynamics and rewards (envs/gridworld.py), checked on hand-built maps."""

import pytest

from rollflash.envs import make_task
from rollflash.envs.gridworld import GridWorld, shortest_action, solvable


def _env(holes, size=3, max_turns=8, **kw) -> GridWorld:
    env = GridWorld(size=size, holes=0, max_turns=max_turns, **kw)
    env.reset(0)
    env.holes = set(holes)
    return env


def test_render_marks_agent_holes_goal():
    env = _env({(0, 1), (2, 0)})
    assert env.render() == "ah./.../h.g?"


def test_move_off_grid_stays_and_goal_pays_one():
    env = _env(set())
    r = env.step("u")  # off the top edge: stays at (0, 0)
    assert (r.done, r.reward, env.pos) == (False, 0.0, (0, 0))
    for a in "ddr":
        r = env.step(a)
    assert not r.done and env.pos == (2, 1)
    r = env.step(" r ")  # whitespace around the action is ignored
    assert r.done and r.reward == 1.0 and r.info["success"] and r.observation == ""


def test_hole_ends_without_reward():
    env = _env({(1, 0)})
    r = env.step("d")
    assert r.done and r.reward == 0.0 and not r.info["success"] and r.info["hole"]


def test_invalid_action_costs_a_turn_and_says_so():
    env = _env(set(), max_turns=2, invalid_reward=-0.5)
    r = env.step("jump")
    assert not r.done and r.reward == -0.5 and r.info["invalid"]
    assert r.observation == "invalid a../.../..g?" and env.pos == (0, 0)
    r = env.step("r")  # second turn = max_turns: truncated
    assert r.done and r.info["truncated"] and not r.info["success"]


def test_reset_is_deterministic_and_always_solvable():
    env = GridWorld(size=4, holes=4)
    for seed in range(200):
        first = env.reset(seed)
        assert env.reset(seed) == first
        assert solvable(4, env.holes) and len(env.holes) == 4


def test_shortest_action_follows_a_safe_shortest_path():
    # a./hh/.g is not 2x2; use 3x3: holes block the first column below the start
    holes = {(1, 0), (1, 1)}
    assert shortest_action(3, holes, (0, 0)) == "r"
    env = _env(holes)
    pos, steps = (0, 0), 0
    while pos != (2, 2):
        r = env.step(shortest_action(3, holes, pos))
        pos, steps = env.pos, steps + 1
    assert steps == 4 and r.reward == 1.0


def test_slip_replaces_moves_reproducibly():
    a, b = GridWorld(size=4, holes=0, slip=0.9), GridWorld(size=4, holes=0, slip=0.9)
    a.reset(3), b.reset(3)
    path_a = [(a.step("r"), a.pos)[1] for _ in range(5)]
    path_b = [(b.step("r"), b.pos)[1] for _ in range(5)]
    assert path_a == path_b
    assert any(p[0] > 0 for p in path_a)  # with slip 0.9 some move is not "r"


def test_task_items_and_bad_params():
    task = make_task("gridworld", {"size": 3, "holes": 1, "heldout_size": 5})
    held = task.heldout_items()
    assert [int(i.answer) for i in held] == list(range(1_000_000_000, 1_000_000_005))
    train = next(task.train_items(0))
    assert int(train.answer) < 1_000_000_000 and train.prompt.startswith("a")
    with pytest.raises(ValueError, match="holes"):
        make_task("gridworld", {"size": 3, "holes": 5})
    with pytest.raises(ValueError, match="unknown parameter 'hole'"):
        make_task("gridworld", {"hole": 1})
    with pytest.raises(TypeError, match="multi-turn"):
        task.score(train, "r")
