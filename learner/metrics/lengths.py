"""Response lengths by what became of a group: the length-bias metrics.

A staleness bound that drops groups still generating when they age out drops long responses
first, and a step that trains short groups ahead of long ones learns from a length-biased sample:
neither shows in the reward. So every step reports, over all ranks (every rank reports the same
values), the mean response length in tokens (EOS included) of
- `length/trained_mean`: the samples the step trains;
- `length/completed_mean`: every sample that arrived in a complete group while the step was
  collected, whatever became of it (trained now or later, filtered, dropped as stale);
- `length/stale_mean`: the samples of the groups dropped as stale (NaN in a step without any;
  their number is `async/dropped_stale`);
with `length/completed_samples` and `length/stale_samples`, the counts behind the means, so that
means over many steps can be weighted. Without length bias `length/trained_mean` follows
`length/completed_mean` (scripts/bench_async.py compares them over a run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollflash.broker.wire.schema import Trajectory

FATES = ("trained", "completed", "stale")


@dataclass
class Lengths:
    """One rank's response tokens and samples per fate, added up while a step is collected."""

    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FATES, 0))
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FATES, 0))

    def add(self, fate: str, group: Trajectory) -> None:
        self.tokens[fate] += sum(len(s.response_ids) for s in group.samples)
        self.samples[fate] += len(group.samples)

    def counts(self) -> list[int]:
        """(tokens, samples) per fate, flat: what the ranks exchange."""
        return [n for fate in FATES for n in (self.tokens[fate], self.samples[fate])]


def length_metrics(ranks: Sequence[Sequence[int]]) -> dict[str, float]:
    """The metrics above from every rank's `Lengths.counts()`."""
    totals = [sum(column) for column in zip(*ranks, strict=True)]
    out: dict[str, float] = {}
    for i, fate in enumerate(FATES):
        tokens, samples = totals[2 * i], totals[2 * i + 1]
        out[f"length/{fate}_mean"] = tokens / samples if samples else float("nan")
        if fate != "trained":  # the trained samples are the step's batch: B x n
            out[f"length/{fate}_samples"] = samples
    return out
