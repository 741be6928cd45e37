"""The `code` reward (envs/code_verifier.py) with the real sandbox: a pass is scored, a wrong
answer is a failed test, every failure mode is a reward of 0 with its counted reason and never an
exception, the per-test and per-sample limits hold, and the reason reaches the wire.

Skipped only with ROLLFLASH_SKIP_SANDBOX_TESTS=1 (never in CI); without bubblewrap they fail."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rollflash.broker.config.config import load_config
from rollflash.broker.wire.schema import Sample, Trajectory, decode_trajectory, encode_trajectory
from rollflash.broker.wire.wire import WireError, WireLimits
from rollflash.envs import Item
from rollflash.envs.code_verifier import CodeLimits, CodeVerifier, extract_program
from rollflash.envs.reward_functions import RewardFunctions
from rollflash.envs.sandbox import SandboxError
from rollflash.envs.scored import Scored, failure_of

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
        (ADD_STDIO, "[" * 20_000 + "]" * 20_000),  # JSON nested past the decoder's recursion
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
    # time_s: room for the honest program on a busy machine; the loop runs out of it anyway
    cfg = load_config(None, ["reward.code.time_s=5", "reward.code.max_workers=2"])
    fns = RewardFunctions.load(["code", "exact"], [1.0, 0.5], 30.0, cfg.reward)
    assert fns.functions[0].limits == CodeLimits(time_s=5.0, max_workers=2)
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


PROGRAM_OBJECTS = """
from decimal import Decimal
from fractions import Fraction

print("noise at import: the program's prints never reach the judge's pipe")
LIMIT = 10


def add(a, b):
    return a + b


def values():
    return {"t": (1, 2), (1, 2): {3, 4}, "f": frozenset([5]), "b": b"\\x00\\xff", "c": 1 + 2j,
            "q": Fraction(1, 3), "d": Decimal("0.1"), "n": None, "big": 2 ** 50000,
            "nan": float("nan"), "nested": [[1, [2, [3]]]], "ba": bytearray(b"x")}


class Solution:
    def two_sum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i


class ListNode:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next


def reverse(head):
    prev = None
    while head:
        head.next, prev, head = prev, head, head.next
    return prev


def count(n):
    yield from range(n)


class Bag:
    def __init__(self, *items):
        self.items = list(items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __contains__(self, x):
        return x in self.items


class BadNumber(ValueError):
    pass


def parse(s):
    if not s.isdigit():
        raise BadNumber(s)
    return int(s)


def apply(f, x):
    return f(x)
"""

TESTS_OBJECTS = [
    "v = values()\nassert v['t'] == (1, 2) and type(v['t']) is tuple and v[(1, 2)] == {3, 4}",
    "v = values()\nassert v['f'] == frozenset([5]) and v['b'] == b'\\x00\\xff' and v['c'] == 1 + 2j",
    "from fractions import Fraction\nfrom decimal import Decimal\nv = values()\n"
    "assert v['q'] == Fraction(1, 3) and v['d'] == Decimal('0.1') and v['n'] is None",
    "import math\nv = values()\nassert v['big'] == 2 ** 50000 and math.isnan(v['nan'])\n"
    "assert v['nested'] == [[1, [2, [3]]]] and v['ba'] == bytearray(b'x')",
    "assert LIMIT == 10 and add(a=2, b=3) == 5",
    "assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]",
    "head = reverse(ListNode(1, ListNode(2, ListNode(3))))\nout = []\n"
    "while head is not None:\n    out.append(head.val)\n    head = head.next\nassert out == [3, 2, 1]",
    "assert list(count(3)) == [0, 1, 2]\nit = iter(count(2))\nassert next(it) == 0",
    "b = Bag(1, 2)\nassert len(b) == 2 and b[1] == 2 and 1 in b and 3 not in b",
    "try:\n    parse('x')\nexcept ValueError as e:\n    assert str(e) == 'x'\n"
    "else:\n    raise AssertionError('no error')",
]


def test_values_objects_and_exceptions_cross_between_the_judge_and_the_program():
    """What a test does with the program's values works across the two sandboxes: tuples, sets,
    bytes, big ints, NaN, fractions as themselves; the program's objects through handles (a
    class's methods, linked nodes, generators, a container's len / [] / in); its exceptions as
    the nearest built-in one. A test that hands the program a function of its own is the row's
    fault (code_bad_tests); a stdout longer than max_output is compared whole."""
    v = CodeVerifier(CodeLimits(time_s=5.0, budget_s=60, max_workers=2))
    long_output = "import sys\nn = int(sys.stdin.buffer.read())\nprint(' '.join(['7'] * n))"
    cases = [
        (PROGRAM_OBJECTS, TESTS_OBJECTS),
        (PROGRAM_OBJECTS, ["assert apply(lambda x: x + 1, 2) == 3"]),
        (long_output, [{"input": "3000", "output": " ".join(["7"] * 3000)}]),  # 5,999 chars
    ]
    got = [(float(s), s.failure) for s in _score(v, cases)]
    v.close()
    assert got == [(1.0, ""), (0.0, "code_bad_tests"), (1.0, "")]
