"""A tool-use environment: answer a numeric question, with a calculator and a Python sandbox.

Each seed draws one question whose answer is an integer, from three templates:
"what is 347*29+18?", "what is the sum of the squares of 1..23?", "what is 1234567 mod 97?".

One action per turn, a tool name, a colon and its argument:
- `calc: <expression>`: integers, + - * // % ** (exponent at most 64, every result under 4096 bits) and
  parentheses, evaluated on
  the parsed syntax tree (never `eval`); observation "result: <value>" or "error: <reason>";
- `python: <code>`: the code runs in `envs.sandbox.Sandbox` (a bubblewrap sandbox: its own
  namespaces, no network, a read-only root, CPU, memory, disk and wall-clock limits, a scratch
  directory kept for the episode); observation "output: <stdout>" or "error: <reason>" (hostile
  code ends as an error observation, never as an exception in the generator);
- `answer: <integer>`: ends the episode, reward 1.0 if it equals the answer (success), else 0.0.
Anything else is invalid: observation "error: unknown tool", reward `invalid_reward`. Tool calls
earn `tool_reward` (default 0). After `max_turns` turns the episode is truncated.

Observations end with a newline, so the next action starts on a fresh line.

No action can raise out of `step`: if a tool itself fails (an exception that is not the model's
code failing cleanly, e.g. the sandbox cannot start a process), the observation is
"error: tool failed (<exception type>)", the episode goes on, and `info["env_error"]` carries the
exception, which the episode counts (`env/errors`, envs/episode.py). Building the environment
fails at once, with one line, where the sandbox cannot run (`envs.sandbox.require_sandbox`).
"""

from __future__ import annotations

import ast
import operator
import random

from rollflash.envs.multiturn import StepResult, TurnLimit, check_positive
from rollflash.envs.sandbox import Sandbox, SandboxLimits, require_sandbox

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPONENT = 64
MAX_BITS = 4096  # bounds every intermediate result, so nested powers cannot hang the generator


def calculate(expression: str) -> int:
    """Evaluate an integer expression (see the module docstring); raises ValueError with a reason."""
    if not isinstance(expression, str):
        raise ValueError("the expression must be text")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: null bytes, unencodable characters
        raise ValueError("syntax error") from None
    except (MemoryError, RecursionError):  # the parser's stack: thousands of nested operators
        raise ValueError("expression too deeply nested") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and not 0 <= right <= MAX_EXPONENT:
                raise ValueError(f"exponent must be in [0, {MAX_EXPONENT}]")
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            value = _BINOPS[type(node.op)](left, right)
            if value.bit_length() > MAX_BITS:
                raise ValueError(f"number too large (over {MAX_BITS} bits)")
            return value
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise ValueError(f"unsupported operator {type(node.op).__name__}")
        raise ValueError(f"unsupported syntax {type(node).__name__}")

    return ev(tree)


def draw_question(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(1, 99)
        return f"what is {a}*{b}+{c}?", a * b + c
    if kind == 1:
        n = rng.randint(10, 60)
        return f"what is the sum of the squares of 1..{n}?", sum(i * i for i in range(1, n + 1))
    a, m = rng.randint(10**5, 10**7), rng.randint(7, 997)
    return f"what is {a} mod {m}?", a % m


class ToolUse(TurnLimit):
    def __init__(
        self,
        max_turns: int = 4,
        tool_reward: float = 0.0,
        invalid_reward: float = 0.0,
        cpu_s: int = 2,
        wall_s: float = 5.0,
        memory_mb: int = 256,
    ) -> None:
        # a tool call is this environment's turn that goes on: it earns `step_reward`
        super().__init__(max_turns, step_reward=tool_reward, invalid_reward=invalid_reward)
        self.limits = SandboxLimits(
            cpu_s=check_positive("cpu_s", cpu_s),
            wall_s=float(wall_s),
            memory_mb=check_positive("memory_mb", memory_mb),
        )
        if not wall_s > 0:
            raise ValueError(f"wall_s must be > 0, got {wall_s}")
        require_sandbox()  # one line naming what is missing, before any episode starts
        self.question, self.answer = "", 0
        self.sandbox: Sandbox | None = None

    def reset(self, seed: int) -> str:
        self._start()
        self.close()
        self.question, self.answer = draw_question(random.Random(seed))
        return self.question + "\n"

    def step(self, action: str) -> StepResult:
        if not isinstance(action, str):
            return self._finish("error: unknown tool\n", self.invalid_reward, False, invalid=True)
        try:
            return self._step(action)
        except Exception as e:  # the tool's own failure, not the model's code failing
            return self._finish(
                f"error: tool failed ({type(e).__name__})\n",
                self.step_reward,
                False,
                env_error=f"{type(e).__name__}: {e}",
            )

    def _step(self, action: str) -> StepResult:
        tool, sep, arg = action.partition(":")
        tool, arg = tool.strip(), arg.strip()
        if not sep or tool not in ("calc", "python", "answer"):
            return self._finish("error: unknown tool\n", self.invalid_reward, False, invalid=True)
        if tool == "answer":
            correct = arg == str(self.answer)
            return self._finish("", 1.0 if correct else 0.0, True, success=correct)
        if tool == "calc":
            try:
                observation = f"result: {calculate(arg)}\n"
            except (ValueError, OverflowError, RecursionError, MemoryError) as e:
                observation = f"error: {e or type(e).__name__}\n"
            return self._finish(observation, self.step_reward, False, tool="calc")
        if self.sandbox is None:
            self.sandbox = Sandbox(self.limits)
        result = self.sandbox.run(arg)
        observation = (
            f"output: {result.output.strip()}\n" if result.ok else f"error: {result.error}\n"
        )
        return self._finish(
            observation, self.step_reward, False, tool="python", tool_error=result.error
        )

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
