"""`rollctl plot RUN_DIR [--compare RUN_DIR2 ...] [--out report.png]`: one PNG of the curves of a
run, read from its `metrics.jsonl` and `summary.json`.

Nine panels: reward (mean, and the score and shaping parts when logged), held-out accuracy and
pass@k (dotted: the accuracy of always giving the most common answer, learner/metrics/health.py),
response length (of the trained samples, of every completed one, and of the groups dropped as
stale: the length bias of asynchrony), the staleness histogram over time, KL and entropy,
learner wait and generator idle, samples/s, the policy loss and the clipped share. A panel whose
metrics a run did not log says so instead of being left out, so reports of different runs keep
one layout. With `--compare`, every run is drawn in its own colour on the same panels; the
staleness panel then shows each run's mean and max instead of the stacked histogram of one run.

A resumed learner cuts metrics.jsonl back to its checkpoint's step (learner/metrics/metrics.py), so each
step has one row; should a file hold a step twice, its last row is the one drawn. matplotlib is
the `plot` extra
(`pip install -e ".[plot]"`); importing this module does not import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollflash.errors import RollflashError

REWARD_PARTS = ("reward/score_mean", "reward/shaping_mean")
# trained and completed as lines; dropped as stale as marks, logged only in steps that drop any
LENGTHS = (
    ("length/trained_mean", "-"),
    ("length/completed_mean", "--"),
    ("length/stale_mean", "x"),
)
KL_KEYS = ("kl/ref_kl", "kl/behav_ref_kl", "policy/approx_kl")


class PlotError(RollflashError, ValueError):
    """A run directory that cannot be plotted; the message names it."""


@dataclass
class RunCurves:
    """One run's metrics as columns: `steps` and, per metric, (step, value) points."""

    name: str
    steps: list[int]
    series: dict[str, list[tuple[int, float]]]
    summary: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> tuple[list[int], list[float]]:
        points = self.series.get(key, [])
        return [s for s, _ in points], [v for _, v in points]

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.series if k.startswith(prefix))


def load_run(run_dir: str | Path) -> RunCurves:
    """Read `{run_dir}/metrics.jsonl` (the last row of each step wins) and summary.json."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    if not rows:
        raise PlotError(f"{path}: no steps logged yet")
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, []).append((step, float(value)))
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return RunCurves(run_dir.name or str(run_dir), sorted(rows), series, summary)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(ax, run: RunCurves, key: str, color, label: str, style: str = "-", window: int = 1):
    x, y = run.get(key)
    if not x:
        return False
    if window > 1:
        ax.plot(x, y, style, color=color, alpha=0.25, linewidth=0.8)
        y = smooth(y, window)
    ax.plot(x, y, style, color=color, label=label, linewidth=1.4)
    return True


def _panel_reward(ax, runs, colors, window):
    drawn = False
    for run, c in zip(runs, colors, strict=True):
        drawn |= _line(ax, run, "reward/mean", c, f"{run.name} mean", window=window)
        if len(runs) == 1:
            for key, style in zip(REWARD_PARTS, ("--", ":"), strict=True):
                drawn |= _line(ax, run, key, c, key.split("/")[1], style, window)
    return drawn


def _panel_eval(ax, runs, colors, window):
    drawn = False
    for run, c in zip(runs, colors, strict=True):
        keys = ["eval/heldout_acc", *run.keys("eval/pass@"), "eval/reward_mean"]
        for key, style in zip(keys, ("o-", "s--", "^:", "d-.", "v-"), strict=False):
            drawn |= _line(ax, run, key, c, f"{run.name} {key.split('/')[1]}", style)
        # the accuracy of always giving the most common answer (learner/metrics/health.py)
        drawn |= _line(ax, run, "eval/top_answer_acc", c, f"{run.name} most common answer", "x:")
        before, after = run.summary.get("heldout_acc_before"), run.summary.get("heldout_acc_after")
        if before is not None and after is not None and run.steps:
            label = f"{run.name} greedy before / after"
            ax.plot([0, run.steps[-1]], [before, after], "*", color=c, markersize=10, label=label)
            drawn = True
    return drawn


def _panel_staleness(ax, runs, colors, window):
    if len(runs) > 1:
        drawn = False
        for run, c in zip(runs, colors, strict=True):
            drawn |= _line(ax, run, "async/staleness_mean", c, f"{run.name} mean", window=window)
            drawn |= _line(ax, run, "async/staleness_max", c, f"{run.name} max", ":")
        return drawn
    run = runs[0]
    hist = run.keys("async/staleness_hist/")
    if not hist:
        return False
    ages = sorted(hist, key=lambda k: int(k.rsplit("/", 1)[1]))
    counts = {k: dict(run.series[k]) for k in ages}
    totals = [sum(counts[k].get(s, 0.0) for k in ages) or 1.0 for s in run.steps]
    shares = [[counts[k].get(s, 0.0) / t for s, t in zip(run.steps, totals, strict=True)]
              for k in ages]  # fmt: skip
    labels = [f"{k.rsplit('/', 1)[1]} versions behind" for k in ages]
    ax.stackplot(run.steps, shares, labels=labels, alpha=0.8)
    ax.set_ylim(0, 1)
    return True


def _panel_length(ax, runs, colors, window):
    """Mean response length of the trained samples, of every completed one and of the groups
    dropped as stale (learner/metrics/lengths.py): trained below completed is a length bias."""
    drawn = False
    for run, c in zip(runs, colors, strict=True):
        for key, style in LENGTHS:
            label = key if len(runs) == 1 else f"{run.name} {key}"
            drawn |= _line(ax, run, key, c, label, style, 1 if style == "x" else window)
    return drawn


def _panel_kl(ax, runs, colors, window):
    """KL on the left axis, entropy (another scale) on the right."""
    drawn = _lines(runs, colors, KL_KEYS, window)(ax)
    if any(run.get("policy/entropy")[0] for run in runs):
        right = ax.twinx()
        right.tick_params(labelsize=8)
        right.set_ylabel("entropy (dash-dot)", fontsize=8)
        for run, c in zip(runs, colors, strict=True):
            _line(right, run, "policy/entropy", c, f"{run.name} entropy", "-.", window)
        right.legend(fontsize=7, loc="lower right")
        drawn = True
    return drawn


def _lines(runs, colors, keys, window):
    def draw(ax, *_):
        drawn = False
        for run, c in zip(runs, colors, strict=True):
            for key, style in zip(keys, ("-", "--", ":", "-."), strict=False):
                label = key if len(runs) == 1 else f"{run.name} {key}"
                drawn |= _line(ax, run, key, c, label, style, window)
        return drawn

    return draw


PANELS = (
    ("reward", "reward (trailing mean; faint: per step)"),
    ("eval", "held-out accuracy / pass@k (* before and after)"),
    ("length", "response length (tokens): trained / completed / stale"),
    ("staleness", "staleness of trained groups"),
    ("kl", "KL and entropy"),
    ("wait", "learner wait / generator idle (share of time)"),
    ("speed", "samples / s"),
    ("loss", "policy loss"),
    ("clip", "clipped share / truncated responses"),
)


def _draw_panel(name: str, ax, runs, colors, window) -> bool:
    per_key = {
        "wait": ("perf/wait_frac", "gen/idle_frac"),
        "speed": ("perf/samples_per_s",),
        "loss": ("loss/policy",),
        "clip": ("policy/clip_frac", "response/truncated_frac"),
    }
    if name == "reward":
        return _panel_reward(ax, runs, colors, window)
    if name == "eval":
        return _panel_eval(ax, runs, colors, window)
    if name == "staleness":
        return _panel_staleness(ax, runs, colors, window)
    if name == "kl":
        return _panel_kl(ax, runs, colors, window)
    if name == "length":
        return _panel_length(ax, runs, colors, window)
    return _lines(runs, colors, per_key[name], window)(ax)


@dataclass
class Report:
    path: Path
    empty_panels: list[str]  # panels no run had metrics for
    legends: dict[str, list[str]] = field(default_factory=dict)  # panel -> its curves' labels


def render(run_dirs: list[str | Path], out: str | Path, window: int = 0) -> Report:
    """Draw the report of `run_dirs` (the first is the main run) into the PNG `out`; `window` is
    the trailing mean of the noisy curves (0 = a tenth of the steps, at least 1)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: this only writes files
    import matplotlib.pyplot as plt

    runs = [load_run(d) for d in run_dirs]
    window = window or max(1, max(len(r.steps) for r in runs) // 10)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    fig, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    empty, legends = [], {}
    for ax, (name, title) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("learner step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if _draw_panel(name, ax, runs, colors, window):
            legend = ax.legend(fontsize=7, loc="best")
            legends[name] = [t.get_text() for t in legend.get_texts()]
        else:
            empty.append(name)
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(" vs ".join(r.name for r in runs) + f"  ({len(runs[0].steps)} steps)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return Report(out, empty, legends)
