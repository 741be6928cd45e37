"""Tools never crash a generator: model-written inputs that used to raise out of `step()` (and so
ended the generator) give an error observation; an exception of a tool or environment becomes an
error observation or a cleanly ended episode, and is counted from the episode to the learner's
`env/errors` metric."""

import numpy as np
import pytest
from sandbox_harness import SKIP_SANDBOX

from rollflash.broker.wire.schema import (
    PromptWork,
    Trajectory,
    decode_trajectory,
    encode_trajectory,
)
from rollflash.broker.wire.wire import WireLimits
from rollflash.envs.episode import Episode
from rollflash.envs.multiturn import StepResult, TurnLimit
from rollflash.envs.sandbox import SandboxError
from rollflash.generators.episodes import episodes_to_trajectory
from rollflash.learner.metrics.metrics import merge_rank_metrics


@SKIP_SANDBOX
@pytest.mark.parametrize(
    "action, observation",
    [
        # the parser's own stack overflows (MemoryError) on thousands of nested operators
        ("calc: " + "-" * 100_000 + "1", "error: expression too deeply nested\n"),
        ("calc: " + "2**" * 10_000 + "2", "error: expression too deeply nested\n"),
        ("calc: " + "1+" * 100_000 + "1", "error: expression too deeply nested\n"),
        ("calc: 2**64**64", "error: exponent must be in [0, 64]\n"),
        ("calc: 9" + "9" * 5000, "error: syntax error\n"),  # over the int-literal digit limit
        ("calc: 1\x00+1", "error: syntax error\n"),
        ("calc: 1+\ud800", "error: syntax error\n"),
        ("calc: ١٢٣+1", "error: syntax error\n"),
        ("python: print('\ud800')", "output: ?\n"),  # a lone surrogate cannot be encoded
        ("python: print('\U0001f600' * 2)", "output: \U0001f600\U0001f600\n"),
        ("\ud800: x", "error: unknown tool\n"),
    ],
)
def test_hostile_inputs_give_error_observations(python_tool, action, observation):
    result = python_tool.step(action)
    assert (result.observation, result.done) == (observation, False)
    assert "env_error" not in result.info  # the model's input was bad, no tool failed


@SKIP_SANDBOX
def test_python_code_with_a_null_byte_is_an_error(python_tool):
    result = python_tool.step("python: print(1)\x00")
    assert result.observation.startswith("error: ") and "null bytes" in result.observation


@SKIP_SANDBOX
@pytest.mark.parametrize("action", [None, 42, b"calc: 1+1", ["answer: 1"]])
def test_an_action_that_is_not_text_is_invalid(python_tool, action):
    result = python_tool.step(action)
    assert result.observation == "error: unknown tool\n" and result.info["invalid"]


@SKIP_SANDBOX
def test_a_failing_tool_is_an_error_observation_and_counted(python_tool, monkeypatch):
    def broken(code):
        raise SandboxError("bwrap: Creating new namespace failed")

    python_tool.step("python: print(1)")  # the sandbox exists now
    monkeypatch.setattr(python_tool.sandbox, "run", broken)
    result = python_tool.step("python: print(2)")
    assert result.observation == "error: tool failed (SandboxError)\n" and not result.done
    assert result.info["env_error"] == "SandboxError: bwrap: Creating new namespace failed"
    assert python_tool.step("calc: 6*7").observation == "result: 42\n"  # the episode goes on


class Raising(TurnLimit):
    """Raises from `where` ("reset", "step" or "close"); otherwise one turn per step, reward 0.5."""

    max_turns = 3

    def __init__(self, where: str) -> None:
        self.where = where

    def reset(self, seed: int) -> str:
        if self.where == "reset":
            raise OSError("disk gone")
        self._start()
        return "start\n"

    def step(self, action: str) -> StepResult:
        if self.where == "step" and self.turns == 1:
            raise KeyError("bug")
        return self._finish("obs\n", 0.5, False)

    def close(self) -> None:
        if self.where == "close":
            raise RuntimeError("leak")


def _play(where: str) -> Episode:
    ep = Episode(
        Raising(where), seed=3, encode=lambda text, first: [ord(c) for c in text], max_tokens=100
    )
    while not ep.done:
        ep.act([7, 8], [-0.1, -0.2], [0, 0], "go")
    ep.close()
    return ep


@pytest.mark.parametrize(
    "where, rewards, truncated, errors",
    [
        ("step", [0.5, 0.0], True, 1),  # ends at the raising step, which earns 0
        ("reset", [0.0], True, 1),  # the first observation is the error; ends at the first action
        ("close", [0.5, 0.5, 0.5], True, 1),  # 3 turns to the limit, then close raises
        ("nowhere", [0.5, 0.5, 0.5], True, 0),
    ],
)
def test_environment_exceptions_end_the_episode_cleanly(where, rewards, truncated, errors):
    ep = _play(where)
    assert (ep.turn_rewards, ep.truncated, ep.env_errors) == (rewards, truncated, errors)
    if where == "reset":
        assert ep.prompt_ids == [ord(c) for c in "error: environment failed (OSError)\n"]


def test_env_errors_reach_the_learner_metric():
    """Episode -> trajectory sample -> wire -> learner step metrics, summed over ranks."""
    from rollflash.learner.loop import step_metrics  # torch: imported only here

    work = PromptWork("train-1", "g1", 2, 0, {"prompt": "p", "answer": "3"})
    trajectory = episodes_to_trajectory(work, [_play("step"), _play("nowhere")], "gen-0")
    assert [s.env_errors for s in trajectory.samples] == [1, 0]
    fields = {
        k.encode(): v if isinstance(v, bytes) else str(v).encode()
        for k, v in encode_trajectory(trajectory).items()
    }
    decoded = decode_trajectory(fields, WireLimits(max_bytes=1_000_000, vocab_size=1000))
    assert isinstance(decoded, Trajectory) and [s.env_errors for s in decoded.samples] == [1, 0]
    assert np.array_equal(decoded.samples[0].response_ids, trajectory.samples[0].response_ids)

    from rollflash.learner.intake.collected import Collected

    collected = Collected(groups=[decoded])  # the collector's own record, its defaults
    wall = {"step_s": 1.0, "train_s": 0.5, "publish_s": 0.0, "checkpoint_s": 0.0}
    metrics = step_metrics(collected, {}, wall)
    assert metrics["env/errors"] == 1
    # two ranks: 1 + 1 = 2 (a count, summed, not averaged)
    assert merge_rank_metrics([(metrics, 1), (metrics, 1)])["env/errors"] == 2
