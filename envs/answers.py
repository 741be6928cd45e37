"""Final answers: what a task's verifier reads from a response, for comparing responses with
each other (learner/metrics/health.py: groups whose samples all answer alike, the held-out set's most
common answer). Not for scoring: the task's reward does that.

A task says how its verifier reads a response with a method
`final_answer(item_id, response) -> str`: a dataset scored by the `math` verifier reads what
follows `####`, else the last `\\boxed{}`, else the last number (envs/verifiers.py
`math_answer`); a reasoning-gym dataset the last `<answer>` span; a mixture asks the item's
domain. A task without one (exact-match tasks, the arithmetic task) is read as the stripped
response.

A task may also say what a right response to an item looks like, with a method
`reference_response(item) -> str | None`: the item's answer written as the task's reward
expects it (the arithmetic task: the answer itself; reasoning-gym: inside its answer tags). The
learner scores a few of them at start to warn when even a right answer cannot reach
`eval.threshold` (learner/evaluation/evaluator.py). A task without one, or that returns None (a program's
expected output is no program), is not checked. Stdlib only, like the rest of envs/.
"""

from __future__ import annotations

from typing import Any


def final_answer(task: Any, item_id: str, response: str) -> str:
    """The final answer of `response` to the item `item_id` of `task` (module docstring)."""
    read = getattr(task, "final_answer", None)
    return read(item_id, response) if read is not None else response.strip()


def reference_response(task: Any, item: Any) -> str | None:
    """A right response to `item`, as `task`'s reward expects it; None where the task cannot
    say (module docstring)."""
    write = getattr(task, "reference_response", None)
    return write(item) if write is not None else None
