"""User reward functions (`reward.functions`, `reward.weights`, `reward.timeout_s`).

A reward function is

    def fn(prompt: str, response: str, answer: str, **row) -> float | None

`prompt` is the text the model was given (chat template applied), `response` the text it wrote
(EOS stripped, envs/base.py), `answer` the row's answer and `row` the row's other columns. A
function marked with `@batched` takes lists instead (`prompts, responses, answers, **columns`,
each column a list) and returns one float per sample: one call per scoring batch, for functions
that amortise a model or a process. The reward is sum_i weights[i] * fn_i (weights default to 1)
over the functions that answered: a function returns None to abstain on a sample it has no
opinion on (a format check for rows of another kind, a judge for rows it does not cover), and
that sample's reward is the weighted sum of the other functions' scores, as TRL's GRPOTrainer
sums the functions that did not return None. Abstentions are not errors: a function may abstain
on every sample of a batch, and the learner counts them per step as
`reward/abstained/<name>`; a sample on which every function abstained has reward 0.

A spec is "package.module:function" (imported, so the package must be importable in every
generator and in the learner), the name of a built-in verifier (envs/verifiers.py: math, exact,
regex, json_schema), or "python:NAME", a Python function given to `rollflash.Run`, which the
caller's process serves to the processes Run starts (envs/remote_rewards.py).

Guarantees:
- Import problems fail at load, one line: `reward.functions[0]: cannot import my_pkg.rewards:f
  (ModuleNotFoundError: No module named 'my_pkg')`.
- Per sample, an exception, a call over `timeout_s` or a return that is not a finite number scores
  0 for that function and counts one error (`errors[spec]`, shown as `reward_errors` in the
  generator's heartbeat, and per step in the learner as `reward/error/<name>`); each function's
  first failure is logged once, with its traceback and the id of the row it failed on.
- With two or more functions, or where one failed, a sample's reward carries each function's own
  score (`Scored.parts`: name -> unweighted score, None where it failed; a function that
  abstained has no entry, and its name is in `Scored.abstained`), which the generator puts on the
  wire (`Sample.reward_parts`, `Sample.reward_abstained`) and the learner averages per step as
  `reward/<name>` over the samples the function scored. A
  function's name is a built-in's own, or the part after ":" of "pkg.module:fn", lowercased,
  with any character other than a-z, 0-9 and _ made "_"; two functions of one list may not share
  a name, nor take one of the learner's own (`mean`, `errors`, `code_*`, ...).
- A row without an answer is bad (envs/dataset.py) only if one of the functions reads the
  answer: every function does unless it says `needs_answer = False` (`code` does; `judge` when
  its template has no {answer}).
- A function that fails on every sample of a scoring batch of at least 2 samples raises
  `RewardFunctionFailed` naming it: the generator exits with code 3 and `rollctl run` stops the
  run, since every later batch would fail the same way.
- A function may return `Scored(value, failure)`, a float that names why the sample failed
  (`code_timeout`, `judge_unparsed`, ...): the model's fault, not the function's, so it is no
  error here; the sample's reward carries the reason (an exception carries `function_error`),
  which the generator puts on the wire (`Sample.reward_failure`) and the learner counts per step
  as `reward/<reason>`.
- A function with `own_deadline = True` (the `code` verifier) bounds its own time and is not
  put under `timeout_s`.
- Timeouts use SIGALRM, so they apply when scoring runs on the main thread (the generator's
  loop); elsewhere calls are not bounded. A call stuck in C code that never returns to the
  interpreter cannot be interrupted this way.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rollflash.envs import remote_rewards
from rollflash.envs.base import Item
from rollflash.envs.scored import Scored, failure_of
from rollflash.envs.user_code import import_function
from rollflash.envs.verifiers import VERIFIERS
from rollflash.errors import RollflashError

log = logging.getLogger(__name__)


class RewardFunctionError(RollflashError, ValueError):
    """A reward function that cannot be loaded (a config error: one line, exit code 2)."""


class RewardFunctionFailed(RollflashError, ValueError):
    """A reward function failed on every sample of a batch: the run cannot go on."""


class RewardTimeout(Exception):
    pass


class _Failed:
    """A function's result on a sample where it raised, timed out or returned a non-number."""


FAILED = _Failed()
Result = float | None | _Failed  # a function's result on one sample: None = it abstained


# metric names of the learner's own under reward/ (learner/metrics/metrics.py): no function may take one
_RESERVED = {
    "mean", "errors", "error", "abstained", "score_mean", "shaping_mean", "function_error"
}  # fmt: skip
_RESERVED_PREFIXES = ("code_", "judge_")  # the code and judge rewards' failure reasons


def function_name(spec: str) -> str:
    """The name of a reward function in metric names (module docstring)."""
    name = re.sub(r"[^a-z0-9_]", "_", spec.rpartition(":")[2].lower()).lstrip("_0123456789")
    return (name or "fn")[:48]


def _names(specs: Sequence[str]) -> list[str]:
    names = [function_name(s) for s in specs]
    for i, (spec, name) in enumerate(zip(specs, names)):
        if name in _RESERVED or name.startswith(_RESERVED_PREFIXES):
            raise RewardFunctionError(
                f"reward.functions[{i}]: {spec} would be named {name!r} in metrics "
                f"(reward/{name}), a name the learner uses itself; rename the function"
            )
        if name in names[:i]:
            other = specs[names.index(name)]
            raise RewardFunctionError(
                f"reward.functions[{i}]: {spec} and {other} share the metric name {name!r}; "
                "rename one of them"
            )
    return names


def batched(fn: Callable[..., Sequence[float]]) -> Callable[..., Sequence[float]]:
    """Mark `fn(prompts, responses, answers, **columns) -> list[float]` as a batched function."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


def load_function(spec: str, index: int, options: Any = None) -> Callable[..., Any]:
    """The callable `spec` names; RewardFunctionError (one line) if it cannot be imported.
    `options`: the `reward:` section, which configures the built-ins that take options."""
    where = f"reward.functions[{index}]"
    if spec.startswith(remote_rewards.PREFIX):
        try:
            return remote_rewards.remote_function(spec)
        except (OSError, LookupError, ValueError) as e:
            raise RewardFunctionError(
                f"{where}: {spec} is a Python function given to rollflash.Run, which only the "
                f"processes Run starts can call ({e}); name it by an import string "
                "('package.module:function') to start processes otherwise"
            ) from None
    if ":" not in spec:
        if spec in CONFIGURED:
            return CONFIGURED[spec](options)
        if spec in VERIFIERS:
            return VERIFIERS[spec]
        raise RewardFunctionError(
            f"{where}: {spec!r} is neither a built-in verifier ({', '.join(known_builtins())}) "
            "nor 'package.module:function'"
        )
    return import_function(spec, where, RewardFunctionError)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise RewardTimeout in this block after `seconds` (main thread only; else unbounded)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"took longer than {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _as_reward(value: Any) -> float | None:
    """A function's return as its score; None (it abstained) stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}, not a finite number nor None")
    return Scored(value, value.failure) if isinstance(value, Scored) else float(value)


def _code(options: Any) -> Callable[..., Any]:
    from rollflash.envs.code_verifier import CodeLimits, CodeVerifier

    code = getattr(options, "code", None)
    return CodeVerifier(CodeLimits(**code.model_dump()) if code is not None else None)


def _judge(options: Any) -> Callable[..., Any]:
    from rollflash.envs.judge import JudgeReward

    if getattr(options, "judge", None) is None:
        raise RewardFunctionError("reward.functions: judge needs the reward.judge options")
    return JudgeReward(options.judge)


# built-ins made from the `reward:` section's options (the others are in VERIFIERS)
CONFIGURED: dict[str, Callable[[Any], Callable[..., Any]]] = {"code": _code, "judge": _judge}


def known_builtins() -> list[str]:
    return sorted([*VERIFIERS, *CONFIGURED])


@dataclass
class RewardFunctions:
    """The configured functions with their weights; scores batches and counts errors."""

    specs: list[str]
    functions: list[Callable[..., Any]]
    weights: list[float]
    timeout_s: float = 10.0
    errors: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # in metrics: reward/<name> (function_name)
    _logged: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.names = self.names or _names(self.specs)

    @classmethod
    def load(
        cls,
        specs: Sequence[str],
        weights: Sequence[float] | None = None,
        timeout_s: float = 10.0,
        options: Any = None,
    ) -> RewardFunctions:
        """`options`: the `reward:` section (for built-ins with options, e.g. `reward.code`)."""
        names = _names(specs)  # before importing anything: a clash is a config error
        fns = [load_function(spec, i, options) for i, spec in enumerate(specs)]
        ws = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
        if len(ws) != len(fns):
            raise RewardFunctionError(
                f"reward.weights: {len(ws)} weights for {len(fns)} reward.functions"
            )
        return cls(list(specs), fns, ws, timeout_s, names=names)

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def needs_answer(self) -> bool:
        """Whether any function reads the row's answer (module docstring)."""
        return any(getattr(fn, "needs_answer", True) for fn in self.functions)

    def _failed(self, k: int, e: BaseException, items: list[Item]) -> None:
        spec = self.specs[k]
        self.errors[spec] = self.errors.get(spec, 0) + len(items)
        if spec not in self._logged:  # its first failure, not one line per sample
            self._logged.add(spec)
            row = items[0].id if len(items) == 1 else f"{items[0].id} (a batch of {len(items)})"
            log.warning(
                "reward function %s failed on row %s: %s: %s (further failures are counted as "
                "reward/error/%s, not logged)",
                spec,
                row,
                e.__class__.__name__,
                e,
                self.names[k],
                exc_info=e,
            )

    def _limit(self, k: int) -> float:
        return 0.0 if getattr(self.functions[k], "own_deadline", False) else self.timeout_s

    def _one(self, k: int, item: Item, response: str) -> Result:
        try:
            with _deadline(self._limit(k)):
                value = self.functions[k](item.prompt, response, item.answer, **item.extra)
            return _as_reward(value)
        except Exception as e:
            self._failed(k, e, [item])
            return FAILED

    def _column(self, k: int, items: list[Item], responses: list[str]) -> list[Result]:
        """Results of function k on the flattened batch: a score, None where it abstained,
        FAILED where it failed."""
        fn = self.functions[k]
        if not getattr(fn, "batched", False):
            return [self._one(k, it, r) for it, r in zip(items, responses)]
        columns: dict[str, list[Any]] = {
            key: [it.extra.get(key) for it in items]
            for key in sorted({key for it in items for key in it.extra})
        }
        try:
            with _deadline(self._limit(k)):
                values = list(
                    fn(
                        [it.prompt for it in items],
                        responses,
                        [it.answer for it in items],
                        **columns,
                    )
                )
            if len(values) != len(items):
                raise TypeError(f"returned {len(values)} rewards for {len(items)} samples")
            return [_as_reward(v) for v in values]
        except Exception as e:
            self._failed(k, e, items)
            return [FAILED] * len(items)

    def score_flat(self, items: list[Item], responses: list[str]) -> list[float]:
        """The weighted reward of each (item, response) pair over the functions that answered,
        a `Scored` naming the first failure where there is one, each function's score and the
        functions that abstained (module docstring); raises RewardFunctionFailed if a function
        raised on every one of at least 2 samples."""
        columns = []
        for k in range(len(self.functions)):
            column = self._column(k, items, responses)
            if len(column) >= 2 and all(v is FAILED for v in column):
                raise RewardFunctionFailed(
                    f"reward.functions[{k}]: {self.specs[k]} failed on all {len(column)} samples "
                    "of a batch; see the generator log for its first error"
                )
            columns.append(column)
        return [self._combine([column[i] for column in columns]) for i in range(len(items))]

    def _combine(self, results: list[Result]) -> float:
        """One sample's reward from each function's result (score, None, FAILED)."""
        total, failure, scores = 0.0, "", dict[str, float | None]()
        abstained = tuple(n for n, v in zip(self.names, results) if v is None)
        for name, weight, v in zip(self.names, self.weights, results):
            if isinstance(v, _Failed):
                failure, scores[name] = failure or "function_error", None
            elif v is not None:
                total += weight * v
                failure, scores[name] = failure or failure_of(v), float(v)
        # each function's score travels with two or more functions, or where one failed
        parts = scores if scores and (len(results) >= 2 or None in scores.values()) else None
        return Scored(total, failure, parts, abstained) if failure or parts or abstained else total
