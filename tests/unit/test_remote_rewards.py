"""Reward functions given to `rollflash.Run` as Python objects, served by the caller's process
(envs/remote_rewards.py): what a child process's proxy returns, counts and refuses. The server
runs in this process's thread here; in a run it is the caller's, and the proxies the children's."""

import threading

import pytest

from rollflash.envs.base import Item
from rollflash.envs.remote_rewards import SOCKET_ENV, serve_functions
from rollflash.envs.reward_functions import RewardFunctionError, RewardFunctions, batched
from rollflash.envs.scored import Scored

ITEMS = [Item(id="a", prompt="1+1=", answer="2"), Item(id="b", prompt="2+2=", answer="4")]


def _exact(prompt, response, answer, **row):
    return float(response == answer)


@batched
def _lengths(prompts, responses, answers, **columns):
    _lengths.calls += 1
    return [len(r) for r in responses]


_lengths.calls = 0


def _boom(prompt, response, answer, **row):
    if response == "5":
        raise KeyError("no such column")
    return 0.5


_OPEN = threading.Event()  # the slow call's gate, opened once its caller has cut it off


def _slow(prompt, response, answer, **row):
    if response != "fast":
        assert _OPEN.wait(120), "the test never opened the gate"
    return 1.0


FUNCTIONS = {
    "python:exact": _exact,
    "python:lengths": _lengths,
    "python:boom": _boom,
    "python:scored": lambda prompt, response, answer, **row: Scored(0.0, "too_long"),
    "python:slow": _slow,
    "python:abstains": lambda prompt, response, answer, **row: None if response == "5" else 1.0,
}


@pytest.fixture
def served(monkeypatch):
    with serve_functions(FUNCTIONS) as env:
        monkeypatch.setenv(SOCKET_ENV, env[SOCKET_ENV])
        yield


def test_served_functions_score_as_local_ones(served):
    fns = RewardFunctions.load(["python:exact", "python:lengths", "python:boom"])
    assert fns.functions[1].batched and not fns.functions[0].batched
    _lengths.calls = 0
    # exact + length + boom (its error scores 0 and is counted)
    # "2": 1 + 1 + 0.5 = 2.5; "5": 0 + 1 + 0 = 1.0
    assert fns.score_flat(ITEMS, ["2", "5"]) == [2.5, 1.0]
    assert _lengths.calls == 1  # a batched function: one call (one round trip) per batch
    assert fns.errors == {"python:boom": 1}


def test_a_scored_failure_crosses_with_its_reason(served):
    (value,) = RewardFunctions.load(["python:scored"]).score_flat(ITEMS[:1], ["x"])
    assert value == 0.0 and value.failure == "too_long"


def test_a_call_over_the_timeout_is_cut_and_the_next_call_works(served):
    _OPEN.clear()
    fns = RewardFunctions.load(["python:slow"], timeout_s=0.5)
    try:  # the slow call waits for a gate only the test opens: it always outlasts the timeout
        assert fns.score_flat(ITEMS[:1], ["slow"]) == [Scored(0.0, "function_error")]
    finally:
        _OPEN.set()
    assert fns.errors == {"python:slow": 1}
    fns.timeout_s = 120  # the next call's limit: only a hang reaches it
    assert fns.score_flat(ITEMS[:1], ["fast"]) == [1.0]  # a new connection


def test_a_process_the_caller_did_not_start_refuses_the_spec(monkeypatch):
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    with pytest.raises(RewardFunctionError) as e:
        RewardFunctions.load(["math", "python:lambda"])
    assert str(e.value) == (
        "reward.functions[1]: python:lambda is a Python function given to rollflash.Run, which "
        f"only the processes Run starts can call (no {SOCKET_ENV} in this process's "
        "environment); name it by an import string ('package.module:function') to start "
        "processes otherwise"
    )


def test_a_name_the_caller_does_not_serve_is_refused(served):
    with pytest.raises(RewardFunctionError, match=r"python:other .* \(the caller serves "):
        RewardFunctions.load(["python:other"])


def test_an_abstention_crosses_as_none(served):
    from rollflash.envs.scored import abstained_of

    fns = RewardFunctions.load(["python:abstains", "python:exact"])
    out = fns.score_flat(ITEMS, ["2", "5"])
    # "2": 1 + 1 = 2.0; "5": abstains, exact 0 -> 0.0; None is no error
    assert out == [2.0, 0.0] and [abstained_of(r) for r in out] == [(), ("abstains",)]
    assert fns.errors == {}
