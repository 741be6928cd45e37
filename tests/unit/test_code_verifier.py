"""The `code` reward (envs/code_verifier.py) with the real sandbox: a pass is scored, a wrong
answer is a failed test, every failure mode is a reward of 0 with its counted reason and never an
exception, the per-test and per-sample limits hold, and the reason reaches the wire.

Skipped only with ROLLFLASH_SKIP_SANDBOX_TESTS=1 (never in CI); without bubblewrap they fail."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from rollflash.broker.config import load_config
from rollflash.broker.schema import Sample, Trajectory, decode_trajectory, encode_trajectory
from rollflash.broker.wire import WireError, WireLimits
from rollflash.envs import Item
from rollflash.envs.code_verifier import CodeLimits, CodeVerifier, extract_program, harness
from rollflash.envs.reward_functions import RewardFunctions, Scored, failure_of
from rollflash.envs.sandbox import SandboxError

pytestmark = pytest.mark.skipif(
    os.environ.get("ROLLFLASH_SKIP_SANDBOX_TESTS") == "1", reason="ROLLFLASH_SKIP_SANDBOX_TESTS=1"
)

STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]
ASSERTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
ADD_STDIO = "a, b = map(int, input().split())\nprint(a + b)"


def _score(verifier: CodeVerifier, cases: list[tuple[str, object]]) -> list[Scored]:
    n = len(cases)
    out = verifier(["p"] * n, [c for c, _ in cases], [""] * n, tests=[t for _, t in cases])
    assert len(out) == n and all(isinstance(v, Scored) for v in out)
    return out


def test_extract_program_takes_the_last_fence_or_the_whole_text():
    assert extract_program("here:\n```python\nprint(1)\n```\nand\n```\nprint(2)\n```") == "print(2)"
    assert extract_program("  print(3)\n") == "print(3)"
    # the program is data in the harness (a string constant), never spliced into its code
    for test in ("assert True", {"input": "", "output": ""}):
        tree = ast.parse(harness("'''; import os", test, "n"))
        constants = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        assert "'''; import os" in constants


def test_passes_wrong_answers_and_every_failure_mode_with_its_reason():
    v = CodeVerifier(CodeLimits(time_s=1.0, memory_mb=128, budget_s=8, max_workers=4))
    cases = [
        (f"Sure:\n```python\n{ADD_STDIO}\n```", STDIO),  # both pass: 2/2
        ("a, b = map(int, input().split())\nprint(a - b)", STDIO),  # 1-2, 5-7: both wrong
        ("def add(a, b):\n    return a + b if a > 0 else 1", ASSERTS),  # 1st passes, 2nd fails
        ("def add(a, b) return a + b", ASSERTS),
        ("def add(a, b):\n    while True: pass", ASSERTS),
        ("x = bytearray(1 << 30)", ASSERTS),  # 1 GiB under a 128 MB address space
        ("import os\nos.abort()", ASSERTS),  # SIGABRT
        ("while True: print('x' * 10000)", ASSERTS),
        ("raise ValueError('no')", ASSERTS),
        ("```python\n```", ASSERTS),
        (ADD_STDIO, "not json"),
        (ADD_STDIO, [{"input": "1"}]),
        (ADD_STDIO, ["assert add(1,"]),  # the row's test does not compile: not the program's fault
    ]
    got = [(float(s), s.failure) for s in _score(v, cases)]
    v.close()
    assert got == [
        (1.0, ""),
        (0.0, ""),  # wrong answers are failed tests, not failures
        (0.5, ""),
        (0.0, "code_syntax"),
        (0.0, "code_timeout"),
        (0.0, "code_oom"),
        (0.0, "code_killed"),
        (0.0, "code_output_limit"),
        (0.0, "code_error"),
        (0.0, "code_no_program"),
        (0.0, "code_bad_tests"),
        (0.0, "code_bad_tests"),
        (0.0, "code_bad_tests"),
    ]


def test_all_or_nothing_and_the_sample_budget():
    half = "def add(a, b):\n    return a + b if a > 0 else 1"
    sleepy = "import time\ndef add(a, b):\n    time.sleep(0.5)\n    return a + b"
    roomy = CodeVerifier(CodeLimits(time_s=2.0, budget_s=120, max_workers=2, all_or_nothing=True))
    (strict,) = _score(roomy, [(half, ASSERTS)])  # a budget no load can use up
    roomy.close()
    v = CodeVerifier(CodeLimits(time_s=2.0, budget_s=1.2, max_workers=2, all_or_nothing=True))
    slow_tests = ["assert add(1, 1) == 2"] * 4  # 4 x (0.5 s of sleep + start) > 1.2 s
    (budget,) = _score(v, [(sleepy, slow_tests)])
    v.close()
    assert (float(strict), strict.failure) == (0.0, "")
    # the budget ends the sample before its 4 tests ran: all-or-nothing scores it 0
    assert (float(budget), budget.failure) == (0.0, "code_budget")


def test_the_memory_limit_is_the_configured_one():
    grab = "x = bytearray(160 << 20)\ndef ok():\n    return 1"
    tests = ["assert ok() == 1"]
    small = CodeVerifier(CodeLimits(memory_mb=128))
    large = CodeVerifier(CodeLimits(memory_mb=512))
    assert small(["p"], [grab], [""], tests=[tests])[0].failure == "code_oom"
    assert float(large(["p"], [grab], [""], tests=[tests])[0]) == 1.0


def test_a_sandbox_that_cannot_start_is_a_counted_zero(monkeypatch):
    import rollflash.envs.code_verifier as cv

    def broken(*a, **k):
        raise SandboxError("bwrap: no namespaces")

    monkeypatch.setattr(cv, "run_tests", broken)
    out = CodeVerifier()(["p"], [ADD_STDIO], [""], tests=[STDIO])
    assert (float(out[0]), out[0].failure) == (0.0, "code_sandbox")


def test_reward_functions_carry_the_reason_and_the_wire_takes_it():
    cfg = load_config(None, ["reward.code.time_s=1", "reward.code.max_workers=2"])
    fns = RewardFunctions.load(["code", "exact"], [1.0, 0.5], 10.0, cfg.reward)
    assert fns.functions[0].limits == CodeLimits(time_s=1.0, max_workers=2)
    # the verifier used on its own has the config's defaults (envs stay free of pydantic)
    assert CodeLimits() == CodeLimits(**load_config(None, []).reward.code.model_dump())
    items = [Item("a", "p", "x", {"tests": STDIO}), Item("b", "p", "x", {"tests": STDIO})]
    out = fns.score_flat(items, [ADD_STDIO, "while True: pass"])
    # 1.0 * code + 0.5 * exact ("x" != response) -> 1.0 and 0.0; the second timed out
    assert [float(r) for r in out] == [1.0, 0.0]
    assert [failure_of(r) for r in out] == ["", "code_timeout"]
    assert fns.total_errors == 0  # the model's failure, not the function's

    def sample(reason: str) -> Sample:
        one = np.array([1], dtype=np.int32)
        return Sample(one, np.array([-0.5], np.float32), one * 0, 0.0, True, reward_failure=reason)

    traj = Trajectory("t", "p", "g", "gen", 0, 0, np.array([1], np.int32))
    traj.samples = [sample("code_timeout"), sample("")]
    raw = {k.encode(): str(v).encode() if not isinstance(v, bytes) else v
           for k, v in encode_trajectory(traj).items()}  # fmt: skip
    decoded = decode_trajectory(raw, WireLimits(max_bytes=1 << 20, max_samples=2))
    assert [s.reward_failure for s in decoded.samples] == ["code_timeout", ""]
    traj.samples = [sample("Code Timeout!"), sample("")]
    raw = {k.encode(): str(v).encode() if not isinstance(v, bytes) else v
           for k, v in encode_trajectory(traj).items()}  # fmt: skip
    with pytest.raises(WireError, match="snake_case"):
        decode_trajectory(raw, WireLimits(max_bytes=1 << 20, max_samples=2))
