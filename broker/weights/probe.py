"""Proof that a generator serves the version it reports: a probe every engine computes.

The probe of a version is the log-probabilities, under its weights, of a fixed sequence of
`PROBE_TOKENS` token ids (`probe_ids`: drawn from the run id, so every process of a run draws the
same), teacher-forced: value t is log_softmax(logits_t)[id_{t+1}] at temperature 1, in float32.
The learner computes it with its own model when it publishes the version (learner/durability/publish.py);
each generator computes it with its own engine once it has loaded the version (the hf engine: a
forward pass; vLLM: `prompt_logprobs`; with a LoRA adapter, through the adapter) and reports it
in its status hash (`probe_fields`). A parameter digest would not do: it says what the engine
holds, not what it computes with (a stale packed copy of a weight, an adapter never attached,
a cache that outlived the weights would all pass it).

The learner's rank 0 checks each report (broker/channels/serving.py) two ways (`verdict`):
- distance: the mean over the probe of |generator - learner| must be within the tolerance. Engines
  differ in kernels and precision: two float32 computations of the same weights agree to about
  1e-6 here, so float32 everywhere gets `FLOAT32_TOLERANCE` (1e-3, a thousand times that); a
  bfloat16 (or float16) engine, or bfloat16 published weights against the learner's float32
  masters, differ by a few 0.01 on average (bfloat16 keeps 8 bits of mantissa: a logit of 10
  is off by up to 0.04, and the weights' own rounding adds as much), so they get
  `HALF_TOLERANCE` (0.25). `weights.probe_tolerance` overrides both.
- frozen: a generator whose probe is bit for bit the one it reported for an earlier version, while
  the learner's moved by more than a hundredth of the tolerance since that version, did not
  apply the updates between. An engine computes the same bits from the same weights and input,
  and a change of the weights changes them: an update that moves the learner's float32 probe by
  1e-5 (ten times what a GPU's non-deterministic reductions can) changes float32 weights, and
  one that moves it by 2.5e-3 flips bfloat16 elements in every layer. So a skipped update is
  caught at the first version that moves the learner's probe that far, long before the
  generator drifts past the tolerance (at lr 1e-6 a step moves a bfloat16 probe by less than
  bfloat16's own noise); an update too small to change the published bytes is never taken
  for one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

PROBE_TOKENS = 32
FLOAT32_TOLERANCE = 1e-3
HALF_TOLERANCE = 0.25
FROZEN_SHARE = 0.01  # of the tolerance: how far the learner's probe must move to expect a change
# in a generator's status hash: its probe, and the one it reported before (of an older version)
FIELDS = ("probe_version", "probe", "probe_dtype", "probe_before_version", "probe_before")


def probe_ids(run_id: str, vocab_size: int) -> list[int]:
    """The probe's token ids: the same in every process of run `run_id`."""
    rng = random.Random(f"rollflash probe {run_id}")
    return [rng.randrange(vocab_size) for _ in range(PROBE_TOKENS)]


@dataclass(frozen=True)
class Report:
    """A generator's probe, as it reported it; `before`: the probe it reported before this one
    (of an older version), so that the learner can compare two of its reports even if it read
    only the later one."""

    version: int
    values: tuple[float, ...]
    dtype: str
    before: Report | None = None


def probe_fields(
    version: int, values: Sequence[float], dtype: str, before: Report | None = None
) -> dict[str, str]:
    """What a generator writes in its status hash (each value exactly: repr round-trips)."""
    fields = {"probe_version": str(version), "probe": _text(values), "probe_dtype": dtype}
    if before is not None:
        fields |= {
            "probe_before_version": str(before.version),
            "probe_before": _text(before.values),
        }
    return fields


def _text(values: Sequence[float]) -> str:
    return ",".join(repr(float(v)) for v in values)


def parse_report(fields: dict[str, str]) -> Report | None:
    """The report in a status hash's `fields` (None: none yet); ValueError if malformed."""
    version, text, dtype, before_version, before_text = (fields.get(k) for k in FIELDS)
    if version is None or text is None:
        return None
    before = None
    if before_version is not None and before_text is not None:
        before = Report(int(before_version), _values(before_text), dtype or "")
        if before.version >= int(version):
            raise ValueError(f"a probe before v{version} of v{before.version}")
    return Report(int(version), _values(text), dtype or "", before)


def _values(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if len(values) != PROBE_TOKENS - 1 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"a probe of {len(values)} values, not {PROBE_TOKENS - 1} log-probs")
    return values


def mean_distance(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def tolerance(published: str, engine: str, configured: float | None) -> float:
    """The distance allowed between a generator's probe and the learner's (module docstring)."""
    if configured is not None:
        return configured
    return FLOAT32_TOLERANCE if published == engine == "float32" else HALF_TOLERANCE


@dataclass(frozen=True)
class LearnerProbe:
    values: tuple[float, ...]
    dtype: str  # the published weights' dtype


def verdict(
    report: Report,
    learner: LearnerProbe,
    before: tuple[Report, LearnerProbe] | None,
    configured: float | None,
) -> str | None:
    """Why `report` does not prove the version it names (None: it does); `before`: the same
    generator's earliest report of an older version with the same values (its probe has not
    changed since), with the learner's probe of that version."""
    allowed = tolerance(learner.dtype, report.dtype, configured)
    d = mean_distance(report.values, learner.values)
    if d > allowed:
        return (
            f"its probe of v{report.version} is {d:.3g} nats from the learner's (mean over "
            f"{len(report.values)} tokens; tolerance {allowed:g} for {report.dtype} on "
            f"{learner.dtype} weights): it does not serve v{report.version}"
        )
    if before is not None:
        old, old_learner = before
        moved = mean_distance(learner.values, old_learner.values)
        if report.values == old.values and moved > FROZEN_SHARE * allowed:
            return (
                f"its probe of v{report.version} is bit for bit its probe of v{old.version}, "
                f"while the learner's moved {moved:.3g} nats: it reports v{report.version} but "
                "did not apply the update"
            )
    return None
