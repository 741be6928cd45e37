"""Bad input at the command line: one clear line naming the cause, a non-zero exit."""

import os
import re
import subprocess
import sys

import yaml

from rollflash.rollctl.preflight import PREFLIGHT_DONE_ENV


def _rollctl(*args, timeout=600):  # bounds a hang: each command ends by itself
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_commands():
    out = _rollctl("--help")
    assert out.returncode == 0
    for command in ("start-learner", "start-generator", "run", "status"):
        assert command in out.stdout


def test_unknown_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"actor_lrr": 0.1}}))
    out = _rollctl("start-learner", "--config", str(path), "--redis-url", "unix:///nowhere")
    assert out.returncode == 2
    from rollflash.broker.config.config import load_config

    known = ", ".join(sorted(load_config(None, []).trainer.model_dump()))  # the section's keys
    assert out.stderr.strip().splitlines() == [
        f"rollctl: error: trainer.actor_lrr: unknown key (known: {known})"
    ]


def test_wrong_type_names_the_key(tmp_path):
    out = _rollctl("run", "--set", "trainer.total_steps=many")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "rollctl: error: trainer.total_steps: expected an integer, got 'many'"
    )


def test_generator_gives_up_on_unreachable_redis_with_a_clear_message(tmp_path):
    out = _rollctl(
        "start-generator",
        "--engine",
        "sim",  # nothing to check before Redis (rollctl/preflight.py)
        "--redis-url",
        f"unix://{tmp_path}/no.sock",
        "--set",
        "redis.connect_timeout_s=3",
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rollctl: error: cannot reach Redis at unix://{tmp_path}/no.sock")
    # the first contact's 1 s, not the 3 s a running process waits out: at most 4 attempts
    # (at 0, 0.2, 0.6 and 1.0 s, tests/integration/test_broker.py), fewer on a slow machine
    assert re.search(r" after [234] attempts in 1s ", last), last
    assert "start redis-server or fix redis.url" in last
    assert "reconnecting in" in out.stderr  # it did retry with backoff before giving up


def test_learner_without_redis_url_says_so():
    out = _rollctl("start-learner")
    assert out.returncode == 2 and "redis.url: not set" in out.stderr


def test_a_missing_engine_stops_rollctl_run_before_anything_starts(tmp_path, tiny_model_dir):
    # the main suite's .venv has no vLLM (it lives in .venv-vllm: make install-vllm)
    import importlib.util

    assert importlib.util.find_spec("vllm") is None, "this test needs a Python without vLLM"
    out = _rollctl(
        "run",
        *("--engine", "vllm", "--generators", "1"),
        *("--set", f"model.path={tiny_model_dir}", "--set", f"run.run_dir={tmp_path / 'run'}"),
    )
    assert out.returncode == 3, out.stderr[-2000:]  # every generator would meet it
    (line,) = out.stderr.splitlines()
    assert line.startswith("rollctl: error: rollout.engine: vllm is not installed in ")
    assert 'pip install -e ".[vllm]"' in line and "make install-vllm" in line
    assert not (tmp_path / "run").exists()  # checked before Redis or any process


# `rollctl start-learner` with the learner's loop replaced by one that fails the way training
# can: the command's own error handling (rollctl/cli_base.py `guarded`) decides what is printed
_FAILING_LEARNER = """
import sys
import rollflash.learner.intake.collect as collect
import rollflash.learner.loop as loop

HOW = sys.argv[-1]

def train_step(batch):
    if HOW == "bug":
        raise ValueError("shapes [4, 3] and [4, 2] do not broadcast")
    raise collect.NoData("no trajectory arrived for 600s at step 3: are generators running?")

def run(cfg, resume, on_step, take_over):
    train_step(None)

loop.run = run
from rollflash.rollctl.cli import main
sys.argv = ["rollctl", *sys.argv[1:-1]]
main()
"""


def _failing_learner(*args: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _FAILING_LEARNER, *args, how],
        env={**os.environ, PREFLIGHT_DONE_ENV: "1"},  # no model here; the loop is replaced
        capture_output=True,
        text=True,
        timeout=600,  # bounds a hang: the command ends by itself
    )


def test_a_value_error_from_inside_training_prints_its_traceback():
    out = _failing_learner("start-learner", "--redis-url", "unix:///nowhere", how="bug")
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert "in train_step" in out.stderr  # where it was raised, not only where it surfaced
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: shapes [4, 3] and [4, 2] do not broadcast"
    )


def test_the_projects_own_error_is_one_line_and_debug_adds_its_traceback():
    out = _failing_learner("start-learner", "--redis-url", "unix:///nowhere", how="nodata")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "rollctl: error: no trajectory arrived for 600s at step 3: are generators running?"
    ]
    debug = _failing_learner("--debug", "start-learner", "--redis-url", "unix:///x", how="nodata")
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr and "in train_step" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == (
        "rollctl: error: no trajectory arrived for 600s at step 3: are generators running?"
    )
