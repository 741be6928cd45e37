"""Range checks of decoded trajectory samples (broker/wire/schema.py's decoder runs them).

Token ids lie in the vocabulary, log-probabilities are finite and <= 0 (up to 1e-4), token
versions in [0, 2^31), rewards within `reward.max_abs_reward`. `check_samples` checks a whole
trajectory with a few array operations and, only when that fails, checks the samples one by one
so that the error names the first bad one, as a per-sample check would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rollflash.broker.wire.wire import WireError, WireLimits, check_name, check_range

MAX_VERSION = 2**31 - 1  # versions travel as int32 token versions


class SampleFields(Protocol):
    """The fields of a decoded sample these checks read (broker/wire/schema.py's `Sample`, which
    imports this module to check what it decodes)."""

    response_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    token_versions: np.ndarray  # [T] int32
    reward: float


def check_samples(samples: Sequence[SampleFields], limits: WireLimits) -> int:
    """Every sample's values in range (`check_sample`), checked over the whole trajectory at
    once; only when that fails are the samples checked one by one, to name the first bad one.
    Returns the oldest token version."""
    cat = np.concatenate
    ids = cat([s.response_ids for s in samples])
    logprobs = cat([s.logprobs for s in samples])
    versions = cat([s.token_versions for s in samples])
    rewards = np.array([s.reward for s in samples])
    high = (limits.vocab_size or 2**31) - 1
    if (
        all(s.response_ids.size for s in samples)
        and ids.min() >= 0
        and ids.max() <= high
        and np.isfinite(logprobs).all()
        and not (logprobs > 1e-4).any()
        and versions.min() >= 0
        and versions.max() <= MAX_VERSION
        and np.abs(rewards).max() <= limits.max_abs_reward
    ):
        return int(versions.min())
    for i, s in enumerate(samples):
        check_sample(s, f"samples[{i}]", limits)
    raise AssertionError("the trajectory-wide check refused what every sample's check accepts")


def check_sample(s: SampleFields, what: str, limits: WireLimits) -> None:
    """Token ids in the vocabulary, log-probabilities finite and <= 0 (up to 1e-4), token
    versions in [0, 2^31), |reward| within `reward.max_abs_reward`."""
    check_ids(s.response_ids, f"{what}.response_ids", limits)
    if not np.all(np.isfinite(s.logprobs)) or np.any(s.logprobs > 1e-4):
        raise WireError(f"{what}.logprobs: not finite or positive", "out_of_range")
    check_range(s.token_versions, 0, MAX_VERSION, f"{what}.token_versions")
    check_range(
        np.array([s.reward]), -limits.max_abs_reward, limits.max_abs_reward, f"{what}.reward"
    )


def check_ids(ids: np.ndarray, what: str, limits: WireLimits) -> None:
    """1-D token ids, at least one, inside the vocabulary."""
    if ids.size == 0:
        raise WireError(f"{what}: empty", "bad_shape")
    high = (limits.vocab_size or 2**31) - 1
    if ids.min() < 0 or ids.max() > high:
        raise WireError(
            f"{what}: token id outside the vocabulary [0, {limits.vocab_size})", "out_of_range"
        )


def check_reward_parts(value: Any, what: str, limits: WireLimits) -> dict[str, float | None]:
    """A sample's `reward_parts`: 1 to `max_reward_parts` entries, each a reward function's
    name (a short snake_case name: it becomes `reward/<name>`) and its score, a finite number
    within `max_abs_reward`, or None where the function failed."""
    if value.__class__ is not dict or not 0 < len(value) <= limits.max_reward_parts:
        raise WireError(
            f"{what}: not a mapping of 1 to {limits.max_reward_parts} scores", "out_of_range"
        )
    out: dict[str, float | None] = {}
    for name, score in value.items():
        if name.__class__ is not str:
            raise WireError(f"{what}: a name is not a string", "bad_type")
        check_name(name, f"{what}[{name[:48]!r}]")
        if score is not None and (
            score.__class__ not in (float, int)
            or not math.isfinite(score)
            or abs(score) > limits.max_abs_reward
        ):
            raise WireError(f"{what}[{name!r}]: not a finite score within range", "out_of_range")
        out[name] = None if score is None else float(score)
    return out


def check_abstained(value: Any, what: str, limits: WireLimits) -> tuple[str, ...]:
    """A sample's `reward_abstained`: 1 to `max_reward_parts` distinct reward function names."""
    if value.__class__ is not list or not 0 < len(value) <= limits.max_reward_parts:
        raise WireError(
            f"{what}: not a list of 1 to {limits.max_reward_parts} names", "out_of_range"
        )
    for name in value:
        if name.__class__ is not str:
            raise WireError(f"{what}: a name is not a string", "bad_type")
        check_name(name, f"{what}[{name[:48]!r}]")
    if len(set(value)) != len(value):
        raise WireError(f"{what}: a name repeats", "out_of_range")
    return tuple(value)


def check_count(value: int, what: str) -> int:
    """A count that travels as a non-negative int32 (a sample's `env_errors`)."""
    if not 0 <= value < 2**31:
        raise WireError(f"{what}: not a count", "out_of_range")
    return value
