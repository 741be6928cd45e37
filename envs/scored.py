"""A reward that says why its sample failed, what each reward function gave and which abstained.

Reward functions (envs/reward_functions.py), the built-in verifiers (envs/code_verifier.py,
envs/judge.py) and the tasks return a `Scored` where a plain float cannot say enough; the
generator reads it with `failure_of`, `parts_of` and `abstained_of` and puts it on the wire.
"""

from __future__ import annotations

from typing import Any


class Scored(float):
    """A reward that says why its sample failed (`failure`, "" when it did not) and, when several
    functions made it, what each gave (`parts`: name -> score, None where the function failed)
    and which functions abstained (`abstained`: their names): a float everywhere else, so
    weighting and the wire see a plain number."""

    failure: str
    parts: dict[str, float | None] | None
    abstained: tuple[str, ...]

    def __new__(
        cls,
        value: float,
        failure: str = "",
        parts: dict[str, float | None] | None = None,
        abstained: tuple[str, ...] = (),
    ) -> Scored:
        out = super().__new__(cls, value)
        out.failure, out.parts, out.abstained = failure, parts, tuple(abstained)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (Scored, (float(self), self.failure, self.parts, self.abstained))


def failure_of(reward: float) -> str:
    """The failure reason a reward carries ("" for a plain number)."""
    return getattr(reward, "failure", "")


def parts_of(reward: float) -> dict[str, float | None] | None:
    """Each function's score a reward carries (None: it carries none)."""
    return getattr(reward, "parts", None)


def abstained_of(reward: float) -> tuple[str, ...]:
    """The names of the functions that abstained on the sample (module docstring)."""
    return getattr(reward, "abstained", ())
