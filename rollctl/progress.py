"""Training progress on a terminal: `rollctl run` and `rollctl start-learner` draw a rich bar

    step 42/150 ━━━━━━━━━━━━╸━━━━━━━━━━━━━━━━━━━━━━━━  reward 0.613  stale<=1  212.4 samples/s  ETA 0:03:36

below the log lines, updated once per learner step from that step's metrics: `rollctl run` reads
them from `{run_dir}/metrics.jsonl` (the learner is its child, writing to a log file), the learner
of `start-learner` gets them from its own loop. The ETA is the steps left times the mean step time
of the last ETA_WINDOW steps (`perf/step_s`). Off a terminal nothing is drawn: the learner's log
line per step is the progress, as in every log file.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from pathlib import Path
from typing import Any, TextIO

ETA_WINDOW = 10  # steps whose mean duration predicts the rest


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def step_text(row: dict[str, Any], eta_s: float | None) -> str:
    """The bar's right-hand text for one metrics row."""
    parts = []
    if row.get("reward/mean") is not None:
        parts.append(f"reward {row['reward/mean']:.3f}")
    if row.get("async/staleness_max") is not None:
        parts.append(f"stale<={int(row['async/staleness_max'])}")
    if row.get("perf/samples_per_s") is not None:
        parts.append(f"{row['perf/samples_per_s']:.1f} samples/s")
    parts.append(f"ETA {format_eta(eta_s)}")
    return "  ".join(parts)


def read_new_rows(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of `path` after byte `offset`, and the offset after them (a line
    still being written is left for the next call). A file shorter than `offset` was cut by a
    resumed learner (learner/metrics/metrics.py): it is read again from its start, and a line that is
    not JSON (read from inside a row) is skipped."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) < offset:
                offset = 0
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    rows = []
    for line in chunk[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict) and "step" in r], offset + end


class StepProgress:
    """A rich progress bar over `total` learner steps (module docstring). `redirect`: while the
    bar is drawn, log records of handlers writing to the console's stream print above it."""

    def __init__(self, total: int, console: Any = None, redirect: bool = True):
        from rich.progress import BarColumn, Progress, TextColumn

        self.total = total
        self._step_s: deque[float] = deque(maxlen=ETA_WINDOW)
        self._progress = Progress(
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            console=console,
            redirect_stdout=redirect,
            redirect_stderr=redirect,
            auto_refresh=False,
        )
        self._task = self._progress.add_task("train", total=total, stats="waiting for step 1")
        self._redirect = redirect
        self._moved: list[tuple[logging.StreamHandler, TextIO]] = []
        self._started = False

    def _start(self) -> None:
        """Draw the bar; log handlers on stdout/stderr now print above it."""
        before = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
        self._progress.start()
        self._started = True
        if not self._redirect:
            return
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in before:
                self._moved.append((h, h.stream))
                h.setStream(getattr(sys, before[id(h.stream)]))  # rich's proxy of that stream

    def update(self, row: dict[str, Any]) -> None:
        """Show the step of metrics row `row` (`step`, `reward/mean`, `perf/step_s`, ...)."""
        if not self._started:
            self._start()
        step = int(row["step"])
        if row.get("perf/step_s") is not None:
            self._step_s.append(float(row["perf/step_s"]))
        mean = sum(self._step_s) / len(self._step_s) if self._step_s else None
        eta = None if mean is None else max(0, self.total - step) * mean
        self._progress.update(self._task, completed=step, stats=step_text(row, eta))
        self._progress.refresh()

    def close(self) -> None:
        if self._started:
            self._progress.stop()
        for handler, stream in self._moved:
            handler.setStream(stream)
        self._moved.clear()
        self._started = False


def terminal_progress(total: int, stream: TextIO) -> StepProgress | None:
    """A bar drawn on `stream` when it is a terminal, else None (the log lines are the record)."""
    if not stream.isatty():
        return None
    from rich.console import Console

    return StepProgress(total, console=Console(file=stream))
