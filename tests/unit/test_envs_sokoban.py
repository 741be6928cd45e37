"""Sokoban dynamics and rewards (envs/sokoban.py)."""

from collections import deque

from rollflash.envs import make_task
from rollflash.envs.gridworld import MOVES
from rollflash.envs.sokoban import Sokoban


def _env(player, box, target, width=4, height=3) -> Sokoban:
    env = Sokoban(width=width, height=height)
    env.reset(0)
    env.player, env.box, env.target = player, box, target
    return env


def test_render_symbols():
    env = _env((0, 0), (1, 1), (1, 2))
    assert env.render() == "######/#@___#/#_$._#/#____#/######?"


def test_push_onto_target_solves():
    env = _env((1, 0), (1, 1), (1, 3))
    r = env.step("r")  # push: box to (1, 2)
    assert not r.done and env.box == (1, 2) and env.player == (1, 1) and r.reward == -0.01
    r = env.step("r")
    assert r.done and r.reward == 1.0 and r.info["success"]


def test_blocked_moves_do_nothing():
    env = _env((1, 2), (1, 3), (0, 0))
    env.step("r")  # the box is against the east wall
    assert env.player == (1, 2) and env.box == (1, 3)
    env = _env((0, 0), (2, 2), (1, 1))
    env.step("u")  # wall
    assert env.player == (0, 0)


def test_invalid_and_truncation():
    env = _env((0, 0), (1, 1), (2, 3))
    env.max_turns = 2
    r = env.step("push")
    assert r.info["invalid"] and r.observation.startswith("invalid ") and not r.done
    r = env.step("u")
    assert r.done and r.info.get("truncated")


def _solvable(env: Sokoban) -> bool:
    """Breadth-first search over (player, box) states with the env's own step()."""
    start = (env.player, env.box)
    seen, todo = {start}, deque([start])
    while todo:
        player, box = todo.popleft()
        for a in MOVES:
            env.player, env.box, env.turns = player, box, 0
            r = env.step(a)
            if r.info.get("success"):
                return True
            state = (env.player, env.box)
            if state not in seen:
                seen.add(state)
                todo.append(state)
    return False


def test_levels_are_deterministic_unsolved_and_solvable():
    env = Sokoban(width=4, height=4, pull_steps=12, max_turns=10_000)
    for seed in range(40):
        obs = env.reset(seed)
        assert env.reset(seed) == obs and env.box != env.target
        assert _solvable(env), seed


def test_registry():
    task = make_task("sokoban", {"width": 3, "height": 3, "heldout_size": 2})
    assert len(task.heldout_items()) == 2
