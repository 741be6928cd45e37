"""The `code` reward: run the program a response wrote against its row's tests in the sandbox.

The program is the last fenced block of the response (```python ... ``` or a bare ``` fence), or
the whole response when it has no fence. The row's `tests` column (a list, or that list as a JSON
string) holds the tests; each is one of
- `{"input": "1 2\\n", "output": "3\\n"}`: the program reads `input` on stdin and passes when its
  stdout equals `output`, both compared with trailing whitespace stripped from every line and
  blank lines at the end ignored (the rule of most stdin/stdout judges);
- a string of Python, e.g. `"assert add(2, 3) == 5"` or a `def test_...` and its call: the
  program is imported as the module `solution` (so its `if __name__ == "__main__":` block does
  not run), the test runs as `__main__` with the names it uses taken from the module (or
  `from solution import ...`, `import solution`), and it passes when it runs to its end.

The program is hostile: a policy trained on this reward finds whatever raises it. Every test of
a sample runs the program in a fresh interpreter in the kernel-isolated sandbox (envs/sandbox.py:
namespaces, seccomp, a bound per call, no network, no project files), with the per-test limits
of `reward.code`: wall and CPU seconds, memory, output. A stdin/stdout test's output is compared
here. A Python test never runs in the program's interpreter (envs/code_judge.py): a judge,
another sandboxed interpreter that the program's process cannot see, signal or write to, runs
the test; each use of a name from `solution` (a call, an attribute, iteration, indexing, `len`,
`in`) is a request to the program's process, and the values cross as JSON plain data (tuples,
dicts, sets, bytes, big ints, floats, fractions, decimals); any other object stays in the
program and is a handle in the judge, equal only to itself. So the test's expected values and
every comparison are the judge's own: reading frames or memory, replacing modules or builtins,
hooks at exit or on exceptions, a result whose `__eq__` always says yes, or exiting early change
only what the program answers. Builtins are the judge's (a program's `sorted` never answers for
the test's); a name the test uses without importing or defining it is the program's. Costs and
limits of this: each use of the program is a round trip between two processes (about 0.2 ms), a
test cannot hand the program objects of its own (a function, an instance of its class:
`code_bad_tests`), and an object of the program compares only by identity (`==` against a
value of the test is False; compare its attributes or a conversion the program returns).

A sample's tests run one after the other within its total budget `budget_s`; the tests still
waiting when it is spent fail. The Python tests of a sample share one judge's sandbox (started
with the first), each against a fresh program's. Samples run in parallel on a pool of
`max_workers` threads, each waiting on its sandboxes' processes, so a scoring batch of S samples
takes about ceil(S / max_workers) samples' time. Samples of one batch whose programs and tests
are equal (a group's samples often agree) run once and share the score.

Reward: the fraction of tests passed, or with `all_or_nothing` 1.0 only if all pass. A response
whose tests cannot all run normally scores what it passed (0 with `all_or_nothing`) and carries
one failure reason (`Scored.failure`, counted by the learner as `reward/<reason>`): the first of
- `code_no_program`: the response holds no code;
- `code_syntax`: the program does not compile (its other tests are not run);
- `code_timeout`: a test ran past its wall-clock or CPU limit;
- `code_oom`: a test ran out of its address space (MemoryError);
- `code_output_limit`: stdout + stderr went past `output_mb`;
- `code_killed`: the process died of a signal (other than the limits above; a SIGKILL sooner
  than its CPU limit could have struck, since RLIMIT_CPU's own kill leaves no trace either);
- `code_error`: the program raised an exception other than AssertionError (at import, or in a
  call the test did not expect to raise), exited non-zero, or answered with something that is
  not plain data;
- `code_exit`: a Python test's program process ended while the test still needed it (any exit
  status below 128 without a traceback, 0 included);
- `code_budget`: the sample's budget ran out before all its tests ran (or cut one short);
- `code_sandbox`: the sandbox itself could not start (not the program's fault; logged);
- `code_bad_tests`: the row's tests are malformed, e.g. a Python test that does not compile or
  that hands the program a value that is not plain data (the row's fault; logged).
A wrong answer (stdout differs, an assertion fails) is a failed test, not a failure reason. No
failure raises: the verifier returns a score for every sample.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rollflash.envs.code_judge import CodeLimits, PythonJudge, Test, stdio_test
from rollflash.envs.sandbox import SandboxError, require_sandbox
from rollflash.envs.scored import Scored
from rollflash.errors import BadInput

__all__ = ["CodeLimits", "CodeVerifier", "extract_program", "parse_tests", "run_tests"]

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, else the whole response (stripped)."""
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


def parse_tests(tests: Any) -> list[Test]:
    """The row's `tests` as a list of stdin/stdout pairs and code strings; ValueError if not."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except RecursionError:
            raise ValueError("tests: JSON nested too deep") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError("tests: expected a non-empty list")
    out: list[Test] = []
    for t in tests:
        if isinstance(t, dict) and set(t) == {"input", "output"}:
            out.append({"input": str(t["input"]), "output": str(t["output"])})
        elif isinstance(t, str):
            try:  # the row's own code (never the model's): compiling runs none of it
                compile(t, "<test>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as e:
                raise ValueError(
                    f"tests: {t[:60]!r} does not compile ({e.__class__.__name__})"
                ) from None
            out.append(t)
        else:
            raise ValueError(f"tests: {str(t)[:60]!r} is neither {{input, output}} nor code")
    return out


@dataclass
class Outcome:
    passed: int
    total: int
    failure: str = ""  # the first failure reason, "" if none


def run_tests(program: str, tests: Sequence[Test], limits: CodeLimits) -> Outcome:
    """Run `program` against `tests` in the sandbox, one after the other (module docstring)."""
    outcome = Outcome(0, len(tests))
    if not program:
        outcome.failure = "code_no_program"
        return outcome
    deadline = time.monotonic() + limits.budget_s
    with PythonJudge(limits) as judge:
        for test in tests:
            left = deadline - time.monotonic()
            if left <= 0.05:
                outcome.failure = outcome.failure or "code_budget"
                break
            wall_s = min(limits.time_s, left)
            if isinstance(test, dict):
                verdict = stdio_test(program, test, limits, wall_s)
            else:
                verdict = judge.test(program, test, wall_s)
            if verdict == "code_timeout" and left < limits.time_s:
                verdict = "code_budget"  # cut by what was left of the budget, not by its limit
            if verdict == "":
                outcome.passed += 1
                continue
            if verdict != "wrong":
                outcome.failure = outcome.failure or verdict
            if verdict == "code_syntax" or limits.all_or_nothing:
                break  # nothing left to learn from the other tests
    return outcome


def _run_key(response: str, tests: Any) -> tuple[str, str]:
    """What decides a sample's score: its program and its row's tests (as JSON; a row whose
    tests cannot be written so is keyed by identity and never shares a run)."""
    try:
        key = json.dumps(tests, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        key = f"id:{id(tests)}"
    return extract_program(response), key


class CodeVerifier:
    """The `code` reward function (batched: one call scores a whole batch on the pool)."""

    batched = True
    own_deadline = True  # bounded by its per-test limits and per-sample budget, not timeout_s
    needs_answer = False  # a row's tests decide, not its answer

    def __init__(self, limits: CodeLimits | None = None) -> None:
        require_sandbox()  # at load: one line if it cannot run; logs the per-call bound
        self.limits = limits or CodeLimits()
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        self._logged: set[str] = set()

    def _score_one(self, response: str, tests: Any) -> Scored:
        try:
            parsed = parse_tests(tests)
        except (ValueError, TypeError) as e:
            self._log_once("code_bad_tests", f"the row's tests are malformed: {e}")
            return Scored(0.0, "code_bad_tests")
        try:
            out = run_tests(extract_program(response), parsed, self.limits)
        except (SandboxError, OSError) as e:
            self._log_once("code_sandbox", f"the sandbox could not run a test: {e}")
            return Scored(0.0, "code_sandbox")
        if out.failure == "code_bad_tests":
            self._log_once(out.failure, "a test hands the program a value that is not plain data")
        if self.limits.all_or_nothing:
            value = 1.0 if out.passed == out.total else 0.0
        else:
            value = out.passed / out.total
        return Scored(value, out.failure)

    def _log_once(self, reason: str, message: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("code reward: %s", message)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        answers: list[str],
        tests: list[Any] | None = None,
        **columns: Any,
    ) -> list[Scored]:
        if tests is None:
            raise BadInput("code: the rows have no `tests` column")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.limits.max_workers, "code-reward")
        # a group's samples often write the same program: each distinct (program, tests) runs once
        keys = [_run_key(r, t) for r, t in zip(responses, tests)]
        first: dict[tuple[str, str], int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        runs = list(first.values())
        scores = self._pool.map(
            self._score_one, [responses[i] for i in runs], [tests[i] for i in runs]
        )
        by_key = dict(zip(first, scores))
        return [by_key[k] for k in keys]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
