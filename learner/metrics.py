"""The one metrics sink: every step's flat, namespaced metrics to JSONL and TensorBoard.

Names are stable (`loss/policy`, `reward/mean`, `async/staleness_max`, `perf/tokens_per_s`, ...)
so dashboards and regression checks can key on them. `{run_dir}/metrics.jsonl` gets one JSON object
per step; `{run_dir}/tb/` holds the TensorBoard events.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsSink:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for name, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


_SUMMED = (
    "async/dropped_stale",
    "async/duplicates",
    "async/late_samples",
    "async/rejected",
    "async/retried",
    "async/staleness_hist/",
    "env/errors",
    "filter/dropped_",
    "redis/",
)  # redis/: counted on rank 0


def merge_rank_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One step's metrics from every rank's (metrics, groups trained): counts add up, `*_max`
    take the maximum, wall times and rates come from rank 0 (the ranks step together), and every
    other value is a mean weighted by the rank's groups."""
    if len(parts) == 1:
        return dict(parts[0][0])
    total = sum(n for _, n in parts) or 1
    out: dict[str, float] = {}
    for key in {k for m, _ in parts for k in m}:
        values = [(m[key], n) for m, n in parts if key in m]
        if key.startswith("perf/"):
            out[key] = parts[0][0].get(key, values[0][0])
            if key in ("perf/samples_per_s", "perf/tokens_per_s"):
                out[key] = sum(v for v, _ in values)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key.startswith(_SUMMED):
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * n for v, n in values) / total
    return out
