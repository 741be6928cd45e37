"""Fixtures of the sandbox attack tests: the real tool environment (envs/tools.py's python tool,
which runs envs/sandbox.py under bubblewrap), and a runner for hostile code."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from sandbox_harness import HOOK_OFF

from rollflash.envs.tools import ToolUse


@pytest.fixture
def python_tool() -> Iterator[ToolUse]:
    env = ToolUse(max_turns=1000, cpu_s=2, wall_s=10.0, memory_mb=256)
    env.reset(0)
    yield env
    env.close()


@pytest.fixture
def run_hostile(python_tool: ToolUse) -> Callable[[str], dict]:
    """Run HOOK_OFF + `code` through the python tool; the code prints one JSON object, returned."""

    def run(code: str) -> dict:
        observation = python_tool.step("python: " + HOOK_OFF + code).observation
        assert observation.startswith("output: "), observation
        return json.loads(observation[len("output: ") :])

    return run
