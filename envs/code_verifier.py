"""The `code` reward: run the program a response wrote against its row's tests in the sandbox.

The program is the last fenced block of the response (```python ... ``` or a bare ``` fence), or
the whole response when it has no fence. The row's `tests` column (a list, or that list as a JSON
string) holds the tests; each is one of
- `{"input": "1 2\\n", "output": "3\\n"}`: the program reads `input` on stdin and passes when its
  stdout equals `output`, both compared with trailing whitespace stripped from every line and
  blank lines at the end ignored (the rule of most stdin/stdout judges);
- a string of Python, e.g. `"assert add(2, 3) == 5"` or a `def test_...` and its call: the
  program is imported as the module `solution` (so its `if __name__ == "__main__":` block does
  not run), the test runs with the module's names (or `from solution import ...`), and it passes
  only when the harness reports that it ran to its end (below).

The program is hostile: a policy trained on this reward finds whatever raises it. Every test is
a fresh interpreter in the kernel-isolated sandbox (envs/sandbox.py: namespaces, seccomp, a bound
per call, no network, no project files), with the per-test limits of `reward.code`: wall and CPU
seconds, memory, output. For a test written in Python the exit status says nothing (the program
may `sys.exit(0)` before the test runs), so the harness compiles the test before the program
runs, keeps its own references to `exec`, `compile` and the builtins (a program that rebinds
them changes only its own), and after the test's last line writes a nonce drawn for this run
alone on stderr. A test passes only when that nonce ends stderr and the process exits 0: a
program that exits first (sys.exit, raise SystemExit, os._exit, a signal to itself, an atexit
handler, a thread that exits) fails with `code_exit` or `code_killed`. What this does not stop,
and docs/security.md says so: a program that reads the harness's own memory (its frames, the
gc, /proc/self/mem) can find the nonce, and an assert only checks what its expressions compute,
so results that override `__eq__`, or a name the test uses shadowed by the program, can pass
it. Both have to be written against the harness; stdin/stdout tests compare text and have
neither weakness. A sample's tests run one after the other within its total
budget `budget_s`; the tests still waiting when it is spent fail. Samples run in parallel on a
pool of `max_workers` threads, each waiting on its sandboxes' processes, so a scoring batch of S
samples takes about ceil(S / max_workers) samples' time. Samples of one batch whose programs and
tests are equal (a group's samples often agree) run once and share the score.

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
- `code_error`: the program raised an exception other than AssertionError, or exited non-zero;
- `code_exit`: a Python test's process ended before its last line (an exit status below 128
  without a traceback, or 0 without the harness's nonce);
- `code_budget`: the sample's budget ran out before all its tests ran (or cut one short);
- `code_sandbox`: the sandbox itself could not start (not the program's fault; logged);
- `code_bad_tests`: the row's tests are malformed, e.g. a Python test that does not compile (the
  row's fault; logged).
A wrong answer (stdout differs, an assertion fails) is a failed test, not a failure reason. No
failure raises: the verifier returns a score for every sample.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rollflash.envs.reward_functions import Scored
from rollflash.envs.sandbox import (
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    require_sandbox,
)
from rollflash.errors import BadInput

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_ERROR_LINE = re.compile(r"^(\w+(?:\.\w+)*)(?::|$)")


@dataclass(frozen=True)
class CodeLimits:
    """The `reward.code` options (broker/config_sections.py documents each)."""

    time_s: float = 2.0
    memory_mb: int = 256
    output_mb: int = 1
    budget_s: float = 10.0
    max_workers: int = 4
    all_or_nothing: bool = False

    def sandbox(self, wall_s: float) -> SandboxLimits:
        cpu_s = max(1, int(self.time_s + 0.999))  # RLIMIT_CPU is whole seconds
        return SandboxLimits(
            cpu_s=cpu_s, wall_s=wall_s, memory_mb=self.memory_mb, file_mb=self.output_mb
        )


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, else the whole response (stripped)."""
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


def parse_tests(tests: Any) -> list[dict[str, str] | str]:
    """The row's `tests` as a list of stdin/stdout pairs and code strings; ValueError if not."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError("tests: expected a non-empty list")
    out: list[dict[str, str] | str] = []
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


def harness(program: str, test: dict[str, str] | str, nonce: str = "") -> str:
    """The code one sandboxed interpreter runs for one test: the program (compiled inside the
    sandbox, so a hostile program never reaches the caller's parser) and then the test. A test
    in Python ends by writing `nonce` on stderr (module docstring)."""
    if isinstance(test, dict):
        return (
            "import io, sys\n"
            f"sys.stdin = io.StringIO({test['input']!r})\n"
            f"__program = compile({program!r}, '<program>', 'exec')\n"
            "exec(__program, {'__name__': '__main__'})\n"
        )
    # every name the harness uses after the program has run is bound before it: default
    # arguments, which the program cannot rebind
    return f"""import builtins, os, sys
def __verify(program, test, nonce, exec=exec, compile=compile, dict=dict, vars=vars,
             write=os.write, exit=os._exit, SystemExit=SystemExit, builtins=builtins):
    test = compile(test, '<test>', 'exec', dont_inherit=True, optimize=0)
    program = compile(program, 'solution.py', 'exec', dont_inherit=True, optimize=0)
    clean = dict(vars(builtins))
    module = type(builtins)('solution')
    sys.modules['solution'] = module
    names = vars(module)
    names['__builtins__'] = dict(clean)
    try:
        exec(program, names)
        names['__builtins__'] = clean
        exec(test, names)
    except SystemExit:
        exit(0)  # no nonce: code_exit
    write(2, b'\\n' + nonce + b'\\n')
__verify({program!r}, {test!r}, {nonce.encode()!r})
"""


def _same_output(got: str, expected: str) -> bool:
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


def classify(result: SandboxResult, limits: CodeLimits, nonce: str = "") -> str:
    """ "" (ran cleanly), "wrong" (an assertion failed) or a failure reason (module docstring).
    `nonce`: a Python test's, which must end its stderr for the test to count as run."""
    if result.ok:
        if nonce and result.stderr.rstrip("\n").rsplit("\n", 1)[-1] != nonce:
            return "code_exit"  # exit status 0, but the harness never reached its last line
        return ""
    error = result.error
    if error.startswith("CPU time limit") and result.wall_s < 0.9 * limits.sandbox(1).cpu_s:
        return "code_killed"  # SIGKILL without a traceback, too soon to be RLIMIT_CPU's
    if error.startswith("timeout after") or error.startswith("CPU time limit"):
        return "code_timeout"
    if error.startswith("output limit") or error.startswith("file size limit"):
        return "code_output_limit"
    if error.startswith("memory limit"):
        return "code_oom"
    name = _ERROR_LINE.match(error)
    kind = name.group(1).rsplit(".", 1)[-1] if name else ""
    if kind == "MemoryError":
        return "code_oom"
    if kind in ("SyntaxError", "IndentationError", "TabError"):
        return "code_syntax"
    if kind == "AssertionError":
        return "wrong"
    status = re.fullmatch(r"exited with status (\d+)", error)
    if status and int(status.group(1)) > 128:
        return "code_killed"
    return "code_exit" if status and nonce else "code_error"


@dataclass
class Outcome:
    passed: int
    total: int
    failure: str = ""  # the first failure reason, "" if none


def run_tests(program: str, tests: Sequence[dict[str, str] | str], limits: CodeLimits) -> Outcome:
    """Run `program` against `tests` in the sandbox, one interpreter per test (module docstring)."""
    outcome = Outcome(0, len(tests))
    if not program:
        outcome.failure = "code_no_program"
        return outcome
    deadline = time.monotonic() + limits.budget_s
    for test in tests:
        left = deadline - time.monotonic()
        if left <= 0.05:
            outcome.failure = outcome.failure or "code_budget"
            break
        nonce = "" if isinstance(test, dict) else secrets.token_hex(16)
        sandbox = Sandbox(limits.sandbox(min(limits.time_s, left)))
        try:
            result = sandbox.run(harness(program, test, nonce))
        finally:
            sandbox.close()
        verdict = classify(result, limits, nonce)
        if verdict == "code_timeout" and left < limits.time_s:
            verdict = "code_budget"  # cut by what was left of the budget, not by its own limit
        if verdict == "" and (isinstance(test, str) or _same_output(result.output, test["output"])):
            outcome.passed += 1
            continue
        if verdict not in ("", "wrong"):
            outcome.failure = outcome.failure or verdict
        if verdict == "code_syntax" or limits.all_or_nothing:
            break  # nothing left to learn from the other tests
    return outcome


def _run_key(response: str, tests: Any) -> tuple[str, str]:
    """What decides a sample's score: its program and its row's tests (as JSON; a row whose
    tests cannot be written so is keyed by identity and never shares a run)."""
    try:
        key = json.dumps(tests, sort_keys=True)
    except (TypeError, ValueError):
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
