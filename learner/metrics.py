"""The one metrics sink: every step's flat, namespaced metrics to JSONL, TensorBoard and trackers.

Names are stable (`loss/policy`, `reward/mean`, `async/staleness_max`, `perf/tokens_per_s`, ...)
so dashboards and regression checks can key on them. `{run_dir}/metrics.jsonl` gets one JSON object
per step; `{run_dir}/tb/` holds the TensorBoard events; W&B and MLflow (learner/trackers.py) get
the same metrics. Sample completions (learner/completions.py) go to `completions.jsonl`,
TensorBoard text and each tracker; so do evaluation's generations (learner/evaluate.py), to
`eval_generations.jsonl` (every one) and TensorBoard text (the first EVAL_TEXT_ROWS of each
evaluation).

The files are the record and their errors end the run; a tracker is a copy, and a tracker call
that raises is counted (`tracker/errors`, in the next rows) and logged, and training goes on.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorboard.compat.proto.summary_pb2 import Summary

from rollflash.broker.config import Config
from rollflash.broker.schema import Trajectory
from rollflash.learner.trackers import Tracker, open_trackers

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

EVAL_TEXT_ROWS = 32  # evaluation generations shown in TensorBoard's text tab per evaluation


class MetricsSink:
    def __init__(
        self, run_dir: str | Path, tensorboard: bool = True, trackers: Sequence[Tracker] = ()
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._tables: dict[str, Any] = {}  # completions.jsonl, ...: opened on first use
        self._tb: SummaryWriter | None = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))
        self.trackers = list(trackers)
        self.tracker_errors = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        if self.trackers:
            clean["tracker/errors"] = self.tracker_errors
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:  # one event per step: TensorBoard shows each value by its tag
            values = [
                Summary.Value(tag=k, simple_value=v) for k, v in clean.items() if v is not None
            ]
            writer = self._tb.file_writer  # torch types it None: its __init__ sets None first
            writer.add_summary(Summary(value=values), step)  # type: ignore[attr-defined]
        self._to_trackers("log", step, clean)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions of the step: one JSON line each, a TensorBoard text table, and a
        table (W&B) or artifact (MLflow) per tracker."""
        if not rows:
            return
        self._write_rows("completions", step, rows)
        if self._tb is not None:
            self._tb.add_text("completions", completions_markdown(rows, COMPLETION_CELLS), step)
        self._to_trackers("log_completions", step, [{"step": step, **r} for r in rows])

    def log_eval_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """One evaluation's generations (learner/evaluate.py) at learner `step`: every one to
        eval_generations.jsonl and each tracker, the first EVAL_TEXT_ROWS to TensorBoard text."""
        if not rows:
            return
        self._write_rows("eval_generations", step, rows)
        if self._tb is not None:
            text = completions_markdown(rows[:EVAL_TEXT_ROWS], EVAL_CELLS)
            self._tb.add_text(f"eval_generations/{rows[0]['eval']}", text, step)
        self._to_trackers("log_eval_generations", step, [{"step": step, **r} for r in rows])

    def _write_rows(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        if name not in self._tables:
            self._tables[name] = open(self.path.with_name(f"{name}.jsonl"), "a", buffering=1)
        self._tables[name].writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)

    def _to_trackers(self, method: str, step: int, payload: Any) -> None:
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(step, payload)
            except Exception as e:  # a tracker is a copy: count it, never stop training
                self.tracker_errors += 1
                log.warning(
                    "tracker %s failed at step %d (%d failures so far): %s",
                    tracker.name,
                    step,
                    self.tracker_errors,
                    str(e).splitlines()[0] if str(e) else e.__class__.__name__,
                )

    def close(self) -> None:
        self._file.close()
        for table in self._tables.values():
            table.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:
                log.warning("tracker %s did not close cleanly: %s", tracker.name, e)


def open_sink(cfg: Config, tracker_ids: dict[str, str]) -> MetricsSink:
    """The learner's sink with the backends of `logging.backends`; `tracker_ids` (from the
    checkpoint: backend -> run id) is filled with the runs it opened, so the next checkpoint
    resumes them."""
    trackers = open_trackers(cfg, tracker_ids)
    tracker_ids.update({t.name: t.run_id() for t in trackers})
    return MetricsSink(
        cfg.run.run_dir, tensorboard="tensorboard" in cfg.logging.backends, trackers=trackers
    )


COMPLETION_CELLS = ("pick", "reward", "staleness", "generator", "prompt", "response")
EVAL_CELLS = ("id", "sample", "reward", "pass", "prompt", "response")


def completions_markdown(rows: list[dict[str, Any]], cols: Sequence[str] = COMPLETION_CELLS) -> str:
    """A markdown table of `cols` for TensorBoard's text tab."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [str(row.get(c, "")).replace("|", "\\|").replace("\n", " ") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reward_breakdown(groups: list[Trajectory]) -> dict[str, float]:
    """Samples whose reward failed, by reason (`reward/<reason>`: `reward/code_timeout`, ...,
    counts); with two or more reward functions each one's mean score `reward/<function>` and,
    whenever one failed, its failures `reward/error/<function>` (counts; names as in
    envs/reward_functions.py); and with a mixture of tasks (envs/mixture.py: prompt ids
    "<domain>/...") each domain's mean reward `reward/<domain>/mean`."""
    out: dict[str, float] = {}
    sums: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    for g in groups:
        domain = g.prompt_id.split("/", 1)[0] if "/" in g.prompt_id else None
        for s in g.samples:
            if s.reward_failure:
                key = f"reward/{s.reward_failure}"
                out[key] = out.get(key, 0) + 1
            for name, score in (s.reward_parts or {}).items():
                if score is None:
                    out[f"reward/error/{name}"] = out.get(f"reward/error/{name}", 0) + 1
                else:
                    parts.setdefault(name, []).append(score)
            if domain is not None:
                sums.setdefault(domain, []).append(s.reward)
    for name, scores in sorted(parts.items()):
        out[f"reward/{name}"] = sum(scores) / len(scores)
    for domain, rewards in sorted(sums.items()):
        out[f"reward/{domain}/mean"] = sum(rewards) / len(rewards)
    return out


_SUMMED = (
    "async/dropped_stale",
    "async/duplicates",
    "async/late_samples",
    "async/prompts_issued",
    "async/rejected",
    "async/retried",
    "async/staleness_hist/",
    "env/errors",
    "filter/dropped_",
    "reward/code_",
    "reward/judge_",
    "reward/function_error",
    "reward/error/",
    "redis/",
)  # redis/: counted on rank 0


def merge_rank_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One step's metrics from every rank's (metrics, groups trained): counts add up, `*_max`
    take the maximum, wall times and rates come from rank 0 (the ranks step together), and every
    other value is a mean weighted by the rank's groups."""
    if len(parts) == 1:
        return dict(parts[0][0])
    out: dict[str, float] = {}
    for key in {k for m, _ in parts for k in m}:
        values = [(m[key], n) for m, n in parts if key in m]
        weight = sum(n for _, n in values) or 1  # a rank without a key (a domain) is left out
        if key.startswith("perf/"):
            out[key] = parts[0][0].get(key, values[0][0])
            if key in ("perf/samples_per_s", "perf/tokens_per_s"):
                out[key] = sum(v for v, _ in values)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key.startswith(_SUMMED):
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * n for v, n in values) / weight
    return out
