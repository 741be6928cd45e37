"""One test of the `code` reward, run in the sandbox and judged outside the program's process
(envs/code_verifier.py has the rules and the failure reasons; docs/security.md the attacks).

- A stdin/stdout test: the program runs in a fresh sandbox as `__main__` with the test's input on
  its real stdin; this process compares its stdout with the expected output.
- A Python test: two sandboxes. The program's (envs/_judge_child.py `serve`), fresh for each
  test, imports the program as the module `solution` and answers requests on it; the judge's
  (`judge`), one for a sample's Python tests, runs each test holding proxies for the names it
  takes from `solution`, and ends each with one verdict line. This process relays each request
  of the judge to the program, and each line the program writes back to the judge framed with
  the test's number (`P<n> <line>`, and `E<n>` at its end), so nothing the program writes can
  read as a new test, as another program's answer or as a verdict; it reads the verdicts from the
  judge's own stdout. The test, its expected values and every comparison live in a process the
  program cannot see, signal or write to (another PID, mount, network and IPC namespace):
  whatever the program does to its own interpreter (frames, `sys.modules`, builtins, hooks,
  `__eq__`, exits) changes only the answers it gives.

The verdict: "" (passed), "wrong" (ran cleanly and failed, e.g. an assertion) or a failure
reason. A test whose judge saw the program's process end (or answer with something that is not
plain data) takes its reason from how the program's process ended.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rollflash.envs._exchange import Exchange, Proc
from rollflash.envs.sandbox import Sandbox, SandboxLimits, SandboxResult

Test = dict[str, str] | str  # {"input", "output"}, or a string of Python
_ERROR_LINE = re.compile(r"^(\w+(?:\.\w+)*)(?::|$)")
_CHILD = Path(__file__).with_name("_judge_child.py")


@dataclass(frozen=True)
class CodeLimits:
    """The `reward.code` options (broker/config/config_sections.py documents each)."""

    time_s: float = 2.0
    memory_mb: int = 256
    output_mb: int = 1
    budget_s: float = 10.0
    max_workers: int = 4
    all_or_nothing: bool = False

    def sandbox(self, wall_s: float) -> SandboxLimits:
        cpu_s = max(1, int(self.time_s + 0.999))  # RLIMIT_CPU is whole seconds
        return SandboxLimits(
            cpu_s=cpu_s,
            wall_s=wall_s,
            memory_mb=self.memory_mb,
            file_mb=self.output_mb,
            max_output=self.output_mb << 20,  # all of stdout: a test compares it whole
        )


@functools.lru_cache(maxsize=1)
def child_source() -> str:
    return _CHILD.read_text()


def stdio_test(program: str, test: dict[str, str], limits: CodeLimits, wall_s: float) -> str:
    """The verdict of a stdin/stdout test (module docstring); raises SandboxError if the
    sandbox could not start."""
    box = Sandbox(limits.sandbox(wall_s))
    try:
        result = box.run(program, stdin=test["input"].encode("utf-8", errors="replace"))
    finally:
        box.close()
    verdict = classify(result, limits)
    return verdict or ("" if _same_output(result.output, test["output"]) else "wrong")


class PythonJudge:
    """The Python tests of one sample: one judge's sandbox for all of them (started with the
    first, started again if it dies), a fresh program's sandbox for each (module docstring).
    Use as a context manager; `test` raises SandboxError if a sandbox could not start."""

    def __init__(self, limits: CodeLimits) -> None:
        self.limits = limits
        self.ex = Exchange()
        self.judge: Proc | None = None
        self.program: Proc | None = None
        self.number = 0  # of the test under way
        self.verdict: dict | None = None
        self._from_judge = bytearray()  # the judge's unfinished line
        self._from_program = bytearray()  # the program's unfinished line

    def __enter__(self) -> PythonJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ex.__exit__(*exc)

    def test(self, program: str, test: str, wall_s: float) -> str:
        """Run `test` against a fresh process of `program` within `wall_s` seconds."""
        deadline = time.monotonic() + wall_s
        self.number += 1
        self.verdict, self._from_program = None, bytearray()
        if self.judge is None:  # the judge's limits are the sample's: it outlives each test
            lim = self.limits.sandbox(self.limits.budget_s)
            lim = dataclasses.replace(lim, cpu_s=max(lim.cpu_s, int(self.limits.budget_s) + 1))
            self.judge = self.ex.start(lim, f"{child_source()}\njudge()\n", keep_open=True,
                                       on_out=self._judge_out, cap_stdout=False)  # fmt: skip
        self.program = self.ex.start(self.limits.sandbox(wall_s),
                                     f"{child_source()}\nserve({program!r})\n", keep_open=True,
                                     on_out=self._program_out)  # fmt: skip
        self.ex.send(self.judge, b"T%d " % self.number + json.dumps(test).encode() + b"\n")
        in_time = self.ex.run(deadline, self._done)
        return self._verdict(in_time)

    def _judge_out(self, chunk: bytes) -> None:
        self._from_judge += chunk
        *lines, rest = self._from_judge.split(b"\n")
        self._from_judge = bytearray(rest)
        for line in lines:
            if line.startswith(b"V"):
                self.verdict = json.loads(line[1:])
            elif self.program is not None:
                self.ex.send(self.program, bytes(line) + b"\n")
        if self.verdict is not None and self.program is not None:
            self.ex.end_input(self.program)  # no more requests: a program still up may exit

    def _program_out(self, chunk: bytes) -> None:
        """Each line the program writes, framed for the judge with its test's number: a line
        of it can never read as the caller's (a new test) or as another program's."""
        assert self.judge is not None
        if not chunk:
            self.ex.send(self.judge, b"E%d\n" % self.number)
            return
        self._from_program += chunk
        *lines, rest = self._from_program.split(b"\n")
        self._from_program = bytearray(rest)
        for line in lines:
            self.ex.send(self.judge, b"P%d " % self.number + bytes(line) + b"\n")

    @property
    def _settled(self) -> bool:
        """The judge's verdict stands on its own: the program's process did not end under it."""
        v = self.verdict
        return v is not None and not (v.get("ended") or v.get("broken"))

    def _done(self) -> bool:
        assert self.judge is not None and self.program is not None
        if self.verdict is None:
            return self.judge.exited  # the judge ended without one
        return self._settled or self.program.exited

    def _verdict(self, in_time: bool) -> str:
        """End the test's program (and the judge, if it did not answer) and judge the test."""
        judge, program, ex = self.judge, self.program, self.ex
        assert judge is not None and program is not None
        if not in_time:
            ex.time_out(program)
        elif not program.exited:
            ex.stop(program)  # its part is over: nothing it does now changes the verdict
        self.program = None
        ran = ex.finish(program)
        if self.verdict is not None:
            return self._judged(ran)
        # no verdict: the judge ended, ran out of time, or one of them flooded its output
        (ex.stop if in_time else ex.time_out)(judge)
        self.judge = None
        judged = ex.finish(judge)
        if program.streams.timed_out or program.streams.flooded:
            return classify(ran, self.limits)
        return classify(judged, self.limits) or "code_error"  # the judge ran out of a limit

    def _judged(self, ran: SandboxResult) -> str:
        v = self.verdict
        assert v is not None
        if self._settled:
            if v.get("pass"):
                return ""
            if v.get("unsendable"):
                return "code_bad_tests"  # the test hands the program something not plain data
            return _error_reason(str(v.get("error", "")))
        # the program's process ended under the test, or broke the protocol
        if v.get("broken") and ran.ok:
            return "code_error"  # it answered with something that is not plain data
        return classify(ran, self.limits, ended=True)


def _error_reason(error: str) -> str:
    """The verdict of an exception line (`Name: message`) that ended a test or a program."""
    name = _ERROR_LINE.match(error)
    kind = name.group(1).rsplit(".", 1)[-1] if name else ""
    if kind == "MemoryError":
        return "code_oom"
    if kind in ("SyntaxError", "IndentationError", "TabError"):
        return "code_syntax"
    return "wrong" if kind == "AssertionError" else "code_error"


def classify(result: SandboxResult, limits: CodeLimits, ended: bool = False) -> str:
    """ "" (ran cleanly), "wrong" (an assertion failed) or a failure reason of a sandboxed run.
    `ended`: the process had to keep serving, so any end of its own is `code_exit`."""
    if result.ok:
        return "code_exit" if ended else ""
    error = result.error
    if error.startswith("CPU time limit") and result.wall_s < 0.9 * limits.sandbox(1).cpu_s:
        return "code_killed"  # SIGKILL without a traceback, too soon to be RLIMIT_CPU's
    if error.startswith("timeout after") or error.startswith("CPU time limit"):
        return "code_timeout"
    if error.startswith("output limit") or error.startswith("file size limit"):
        return "code_output_limit"
    if error.startswith("memory limit"):
        return "code_oom"
    status = re.fullmatch(r"exited with status (\d+)", error)
    if status:
        if int(status.group(1)) > 128:
            return "code_killed"
        return "code_exit" if ended else "code_error"
    return _error_reason(error)


def _same_output(got: str, expected: str) -> bool:
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)
