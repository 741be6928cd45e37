"""Task interface, arithmetic rewards worked out by hand, and the registry's errors."""

import itertools

import pytest

from rollflash.envs import Item, Task, make_task
from rollflash.envs.arithmetic import ArithmeticTask


@pytest.fixture
def task() -> ArithmeticTask:
    return ArithmeticTask(ops=("+", "-"), a_range=(0, 99), b_range=(0, 99), heldout_size=50)


ITEM = Item(id="t", prompt="17+25=", answer="42")


def test_is_a_task(task):
    assert isinstance(task, Task)
    assert task.name == "arithmetic"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("42", 1.1),  # exact (1.0) + well-formed integer (0.1)
        ("41", 0.1),  # wrong but well formed
        ("-42", 0.1),  # sign allowed in format, still wrong
        ("042", 0.1),  # leading zero: well formed (3 chars <= max 3), not exact
        ("42 ", 0.0),  # trailing space: neither exact nor a bare integer
        (" 42", 0.0),
        ("42=", 0.0),
        ("", 0.0),
        ("4242", 0.0),  # 4 chars > max_answer_len 3 (99+99=198): a run-on, not well formed
        ("abc", 0.0),
    ],
)
def test_score_by_hand(task, response, expected):
    assert task.max_answer_len == 3  # longest answers: "198" and "-99"
    assert task.score(ITEM, response) == pytest.approx(expected, abs=1e-12)


def test_negative_answer_and_custom_format_reward():
    t = ArithmeticTask(a_range=(0, 9), b_range=(0, 9), heldout_size=5, format_reward=0.0)
    item = Item(id="t", prompt="3-7=", answer="-4")
    assert t.score(item, "-4") == 1.0  # exact, format term disabled
    assert t.score(item, "4") == 0.0


def test_items_are_correct(task):
    items = list(itertools.islice(task.train_items(0), 200)) + task.heldout_items()
    for it in items:
        a, b = (int(x) for x in it.prompt.rstrip("=").replace("-", " ").replace("+", " ").split())
        expected = a + b if "+" in it.prompt else a - b
        assert it.answer == str(expected)
        assert task.score(it, it.answer) == pytest.approx(1.1)


def test_train_items_deterministic_per_seed(task):
    first = list(itertools.islice(task.train_items(7), 100))
    again = list(itertools.islice(task.train_items(7), 100))
    other = list(itertools.islice(task.train_items(8), 100))
    assert first == again
    assert first != other
    assert [it.id for it in first[:2]] == ["train-000000", "train-000001"]


def test_heldout_fixed_and_disjoint_from_train():
    # Small problem space (2 ops x 10 x 10 = 200) so train streams revisit every problem many times.
    t = ArithmeticTask(a_range=(0, 9), b_range=(0, 9), heldout_size=40)
    heldout = t.heldout_items()
    assert len(heldout) == 40 and len({it.prompt for it in heldout}) == 40
    assert (
        heldout == ArithmeticTask(a_range=(0, 9), b_range=(0, 9), heldout_size=40).heldout_items()
    )
    held_prompts = {it.prompt for it in heldout}
    for seed in range(3):
        train_prompts = {it.prompt for it in itertools.islice(t.train_items(seed), 3000)}
        assert not train_prompts & held_prompts
        assert len(train_prompts) == 160  # every non-held-out problem shows up


def test_make_task_builds_with_params():
    t = make_task(
        "arithmetic", {"ops": ["*"], "a_range": [2, 3], "b_range": [4, 5], "heldout_size": 2}
    )
    assert all("*" in it.prompt for it in t.heldout_items())


def test_unknown_task_names_known_ones():
    with pytest.raises(ValueError, match=r"unknown task 'arith'.*arithmetic"):
        make_task("arith", {})


def test_unknown_param_names_the_key():
    with pytest.raises(ValueError, match=r"unknown parameter 'heldout_sz'.*heldout_size"):
        make_task("arithmetic", {"heldout_sz": 10})


def test_an_environment_task_takes_the_class_parameters_and_heldout_size():
    task = make_task("gridworld", {"size": 3, "holes": 1, "heldout_size": 3})
    env = task.make_env()
    assert (env.size, env.n_holes, env.max_turns) == (3, 1, 8)  # max_turns: GridWorld's default
    assert [it.id for it in task.heldout_items()] == [
        "heldout-0000",
        "heldout-0001",
        "heldout-0002",
    ]
    assert len(make_task("sim_env").heldout_items()) == 8  # the registry's default for sim_env
    accepted = "size, holes, max_turns, slip, step_reward, invalid_reward, heldout_size"
    with pytest.raises(
        ValueError, match=f"^unknown parameter 'sise' for task 'gridworld'; accepted: {accepted}$"
    ):
        make_task("gridworld", {"sise": 3})


@pytest.mark.parametrize(
    "name, accepted, defaults",
    [
        ("gridworld", "size, holes, max_turns, slip, step_reward, invalid_reward", (8, 0.0, 0.0)),
        (
            "sokoban",
            "width, height, pull_steps, max_turns, step_reward, invalid_reward",
            (16, -0.01, -0.01),
        ),
        (
            "sim_env",
            "min_turns, max_turns, step_latency_s, latency_sigma, obs_chars, success_prob",
            (6, 0.0, 0.0),
        ),
        (
            "tool_use",
            "max_turns, tool_reward, invalid_reward, cpu_s, wall_s, memory_mb",
            (4, 0.0, 0.0),
        ),
    ],
)
def test_each_environment_lists_its_own_keys_and_turnlimit_checks_the_shared_ones(
    name, accepted, defaults
):
    # the registry reads the keys from the environment's signature; TurnLimit checks max_turns
    with pytest.raises(ValueError, match=f"; accepted: {accepted}, heldout_size$"):
        make_task(name, {"turns": 3})
    with pytest.raises(ValueError, match="^max_turns must be a positive integer, got 0$"):
        make_task(name, {"max_turns": 0})
    env = make_task(name, {"heldout_size": 1}).make_env()
    assert (env.max_turns, env.step_reward, env.invalid_reward) == defaults
    assert make_task(name, {"max_turns": 3}).make_env().max_turns == 3


@pytest.mark.parametrize(
    "params, match",
    [
        ({"ops": ["/"]}, "ops"),
        ({"a_range": [5, 1]}, "a_range"),
        ({"b_range": [-1, 3]}, "b_range"),
        ({"a_range": [0, 1], "b_range": [0, 1], "heldout_size": 5}, "heldout_size"),
        ({"format_reward": -0.1}, "format_reward"),
    ],
)
def test_bad_params_name_the_key(params, match):
    with pytest.raises(ValueError, match=match):
        make_task("arithmetic", params)
