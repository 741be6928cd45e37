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
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
                 for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for name, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
