"""The one metrics sink: every step's flat, namespaced metrics to JSONL, TensorBoard and trackers.

Names are stable (`loss/policy`, `reward/mean`, `async/staleness_max`, `perf/tokens_per_s`, ...)
so dashboards and regression checks can key on them. `{run_dir}/metrics.jsonl` gets one JSON object
per step; `{run_dir}/tb/` holds the TensorBoard events; W&B and MLflow (learner/metrics/trackers.py) get
the same metrics. Sample completions (learner/metrics/completions.py) go to `completions.jsonl`,
TensorBoard text and each tracker; so do evaluation's generations (learner/evaluation/eval_generate.py), to
`eval_generations.jsonl` (every one) and TensorBoard text (the first EVAL_TEXT_ROWS of each
evaluation).

The files are the record and their errors end the run; a tracker is a copy, and a tracker call
that raises is counted (`tracker/errors`, in the next rows) and logged, and training goes on.

A learner resumed from step s (`resume_step`; 0 without a checkpoint) trains steps s + 1 ... again,
so the sink first cuts metrics.jsonl and completions.jsonl before their first row of a later
step (one truncate each: the rows are in step order, since every resume cuts them), and
TensorBoard purges the events after s (`purge_step`). A tracker run resumed from the checkpoint
(learner/metrics/trackers.py) may still show the rolled-back steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorboard.compat.proto.summary_pb2 import Summary

from rollflash.broker.config.config import Config
from rollflash.broker.connect.secrets import make_private_dir
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.metrics.metric_sums import MetricSums, merged
from rollflash.learner.metrics.trackers import Tracker, open_trackers

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

EVAL_TEXT_ROWS = 32  # evaluation generations shown in TensorBoard's text tab per evaluation


def cut_after(path: Path, step: int) -> int:
    """Truncate the JSON lines of `path` before the first row of a step after `step` (or a line
    that is not a whole row: a crash cut it short); returns how many lines went."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        lines = f.readlines()
    offset = 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        kept = isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step
        if not (kept and line.endswith(b"\n")):
            os.truncate(path, offset)
            return len(lines) - i
        offset += len(line)
    return 0


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        trackers: Sequence[Tracker] = (),
        resume_step: int | None = None,
    ):
        """`resume_step`: the step the learner resumes from; rows after it are cut (module
        docstring). None: append to what is there."""
        self.path = Path(run_dir) / "metrics.jsonl"
        make_private_dir(self.path.parent)
        if resume_step is not None:
            for name in (self.path, self.path.with_name("completions.jsonl")):
                if cut := cut_after(name, resume_step):
                    log.warning("%s: cut %d rows after step %d (resumed)", name, cut, resume_step)
        self._file = open(self.path, "a", buffering=1)
        self._tables: dict[str, Any] = {}  # completions.jsonl, ...: opened on first use
        self._tb: SummaryWriter | None = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = Path(run_dir) / "tb"
            purge = resume_step + 1 if resume_step is not None and tb.exists() else None
            self._tb = SummaryWriter(log_dir=str(tb), purge_step=purge)
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
        """One evaluation's generations (learner/evaluation/eval_generate.py) at learner `step`: every one to
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


def open_sink(cfg: Config, tracker_ids: dict[str, str], resume_step: int) -> MetricsSink:
    """The learner's sink with the backends of `logging.backends`, for a learner at
    `resume_step` (0 on a fresh run); `tracker_ids` (from the checkpoint: backend -> run id) is
    filled with the runs it opened, so the next checkpoint resumes them."""
    trackers = open_trackers(cfg, tracker_ids)
    tracker_ids.update({t.name: t.run_id() for t in trackers})
    return MetricsSink(
        cfg.run.run_dir,
        tensorboard="tensorboard" in cfg.logging.backends,
        trackers=trackers,
        resume_step=resume_step,
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
    counts); with two or more reward functions each one's mean score `reward/<function>` over
    the samples it scored and, whenever one failed or abstained, its failures
    `reward/error/<function>` and abstentions `reward/abstained/<function>` (counts; names as in
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
            for name in s.reward_abstained:
                out[f"reward/abstained/{name}"] = out.get(f"reward/abstained/{name}", 0) + 1
            if domain is not None:
                sums.setdefault(domain, []).append(s.reward)
    for name, scores in sorted(parts.items()):
        out[f"reward/{name}"] = sum(scores) / len(scores)
    for domain, rewards in sorted(sums.items()):
        out[f"reward/{domain}/mean"] = sum(rewards) / len(rewards)
    return out


def merge_rank_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One step's metrics from every rank's (metrics, groups trained), reduced as
    learner/metrics/metric_sums.py reduces every metric: counts add up, `*_max` take the maximum, wall
    times come from rank 0, and a rank's sample statistics are means weighted by its groups (a
    rank without a key, a domain it did not see, is left out). The training metrics are not
    among them: `train_step` returns them already reduced over the ranks."""
    return merged([MetricSums().add(m, float(n)) for m, n in parts]).values()
