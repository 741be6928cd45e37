"""One reduction for the learner's metrics: over micro-batches, over a step's updates, over ranks.

A metric travels as a sum and a weight, and its name says how two of them combine:

- `*_max`: the maximum;
- a count (names starting with one of COUNTED: samples dropped, errors, skipped updates, the
  throughputs): the sum;
- `perf/` wall times: rank 0's (the ranks step together);
- anything else, a weighted mean: the sum of weight x value over the sum of the weights, where
  the weight is what the value is a mean over: the tokens of a token mean (clip fractions, ratios,
  the k3 metrics, mismatch, critic statistics), the loss denominator of a value aggregated by
  `loss_agg_mode` (AGGREGATED: tokens with token-mean, non-empty rows with the seq-mean modes),
  a rank's groups for its sample statistics (`reward/mean`, ...), and 1 for a value of a whole
  update or step that every rank shares (gradient norms, batch statistics, the learning rate).

Combining is associative and a weighted mean of parts with their true weights is the mean of the
whole, so a step's metrics do not depend on how its data was split into micro-batches and ranks:
N ranks report what one rank reports (tests/integration/test_distributed_learner.py). The one
exception is `critic/explained_var`, a ratio of variances per micro-batch whose token-weighted
mean depends on the split.

On the device the sums stay tensors; `to_host` copies all of them in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

COUNTED = (
    "async/dropped_stale",
    "async/duplicates",
    "async/late_samples",
    "async/prompts_issued",
    "async/rejected",
    "async/retried",
    "async/staleness_hist/",
    "critic/nonfinite_skipped",
    "env/errors",
    "filter/dropped_",
    "mismatch/sum/",
    "optim/nonfinite_skipped",
    "optim/updates",
    "perf/samples_per_s",
    "perf/tokens_per_s",
    "reward/code_",
    "reward/judge_",
    "reward/function_error",
    "reward/error/",
    "reward/abstained/",
    "redis/",
)  # counts a value every rank shares (redis/, the skipped updates) are counted on rank 0 only

# values reduced by loss_agg_mode: weighted by the loss's denominator, not by tokens
AGGREGATED = ("loss/", "policy/entropy", "kl/ref_kl")

Value = torch.Tensor | float


def kind(name: str) -> str:
    """How `name` combines: "max", "sum", "first" or "mean" (module docstring)."""
    if name.endswith("_max"):
        return "max"
    if name.startswith(COUNTED):
        return "sum"
    return "first" if name.startswith("perf/") else "mean"


def _maximum(a: Value, b: Value) -> Value:
    if isinstance(a, float) and isinstance(b, float):
        return max(a, b)
    device = a.device if isinstance(a, torch.Tensor) else b.device  # type: ignore[union-attr]
    return torch.maximum(torch.as_tensor(a, device=device), torch.as_tensor(b, device=device))


class MetricSums:
    """Metrics as sums (weighted sums for the means) and the means' weights."""

    def __init__(
        self, sums: dict[str, Value] | None = None, weights: dict[str, float] | None = None
    ):
        self.sums: dict[str, Value] = dict(sums or {})
        self.weights: dict[str, float] = dict(weights or {})

    def add(
        self,
        metrics: Mapping[str, Value],
        weight: float | Callable[[str], float] = 1.0,
    ) -> MetricSums:
        """Fold in values (0-dim tensors or floats); each mean's weight is `weight`, or
        `weight(name)`. Returns self."""
        for name, value in metrics.items():
            v: Value = (
                value.detach().float().reshape(())
                if isinstance(value, torch.Tensor)
                else float(value)
            )
            w = float(weight(name) if callable(weight) else weight)
            self._fold(name, v if kind(name) != "mean" else v * w, w)
        return self

    def merge(self, other: MetricSums) -> MetricSums:
        """Fold in another part's sums (another micro-batch, update or rank). Returns self."""
        for name, s in other.sums.items():
            self._fold(name, s, other.weights.get(name, 0.0))
        return self

    def _fold(self, name: str, s: Value, w: float) -> None:
        prev, k = self.sums.get(name), kind(name)
        if k == "mean":
            self.weights[name] = self.weights.get(name, 0.0) + w
        if prev is None:
            self.sums[name] = s
        elif k == "max":
            self.sums[name] = _maximum(prev, s)
        elif k != "first":
            self.sums[name] = prev + s

    def to_host(self) -> MetricSums:
        """The same sums as floats, copied from the device in one transfer."""
        names = [k for k, v in self.sums.items() if isinstance(v, torch.Tensor)]
        sums = dict(self.sums)
        if names:
            device = sums[names[0]].device  # type: ignore[union-attr]
            stacked = torch.stack([torch.as_tensor(sums[k], device=device) for k in names])
            sums.update(zip(names, stacked.tolist()))
        return MetricSums(sums, self.weights)

    def values(self) -> dict[str, float]:
        """name -> value: a mean is its weighted sum over its weight (0 with no weight)."""
        host = self.to_host().sums
        out = {}
        for name, s in host.items():
            w = self.weights.get(name, 0.0)
            out[name] = float(s) if kind(name) != "mean" else (float(s) / w if w else 0.0)
        return out


def micro_batch_weights(tokens: int, denominator: int) -> Callable[[str], float]:
    """The weights of a micro-batch's metrics: its part of the loss denominator for a value
    AGGREGATED by loss_agg_mode, its selected tokens for a token mean."""
    return lambda name: float(denominator if name.startswith(AGGREGATED) else tokens)


def merged(parts: list[MetricSums]) -> MetricSums:
    """The parts (in rank order, for "first") combined into one."""
    out = MetricSums()
    for part in parts:
        out.merge(part)
    return out
