"""Progress of `rollctl run` / `start-learner`: the bar's text rendered by rich from a fake
metrics file, and the path off a terminal (no bar: the learner's log lines, echoed as they are)."""

from __future__ import annotations

import io
import json

from rich.console import Console

from rollflash.rollctl.progress import StepProgress, read_new_rows, step_text, terminal_progress
from rollflash.rollctl.supervise import LearnerWatch


def _row(step, step_s=2.0):
    return {"step": step, "reward/mean": 0.1 * step, "async/staleness_max": 1,
            "perf/samples_per_s": 85.33, "perf/step_s": step_s}  # fmt: skip


def test_step_text_has_reward_staleness_speed_and_eta():
    # 7 steps left at 2.0 s each -> 14 s
    assert step_text(_row(3), 14.0) == "reward 0.300  stale<=1  85.3 samples/s  ETA 0:00:14"
    assert step_text({"step": 1}, None) == "ETA -"
    assert step_text({"step": 1}, 3725.4) == "ETA 1:02:05"


def test_read_new_rows_leaves_a_half_written_line_for_later(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_new_rows(path, 0) == ([], 0)  # not there yet
    first = json.dumps(_row(1)) + "\n"
    path.write_text(first + '{"step": 2, "rew')
    rows, offset = read_new_rows(path, 0)
    assert rows == [_row(1)] and offset == len(first)
    with open(path, "a") as f:
        f.write('ard/mean": 0.5}\n')
    assert read_new_rows(path, offset) == ([{"step": 2, "reward/mean": 0.5}], path.stat().st_size)


def test_read_new_rows_starts_again_when_a_resumed_learner_cut_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2, 3)))
    _, offset = read_new_rows(path, 0)  # what `rollctl run` had seen when the learner started
    path.write_text(json.dumps(_row(1)) + "\n")  # resumed from step 1: rows 2, 3 cut
    rows, after = read_new_rows(path, offset)
    assert rows == [_row(1)] and after == path.stat().st_size
    # cut, then grown past the old offset before the next look: the row read from its middle
    # is skipped, never raised
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2, 3, 4)))
    assert read_new_rows(path, offset - 5)[0] == [_row(4)]  # inside row 3, which is skipped


def test_the_bar_renders_step_total_and_eta_from_a_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # step times 1, 2, 3 s: mean 2 s, 10 - 3 = 7 steps left -> ETA 0:00:14
    path.write_text("".join(json.dumps(_row(s, float(s))) + "\n" for s in (1, 2, 3)))
    console = Console(record=True, force_terminal=True, width=120, file=io.StringIO())
    bar = StepProgress(10, console=console, redirect=False)
    rows, _ = read_new_rows(path, 0)
    for row in rows:
        bar.update(row)
    bar.close()
    # the recording holds each redraw in turn; the last is the bar at step 3
    last = "step " + console.export_text().strip().rsplit("step ", 1)[1]
    assert last.startswith("step 3/10 ━")
    assert last.endswith(" reward 0.300  stale<=1  85.3 samples/s  ETA 0:00:14")


def test_off_a_terminal_there_is_no_bar_and_the_log_is_echoed_as_it_is(tmp_path, capsys):
    assert terminal_progress(10, io.StringIO()) is None  # not a TTY
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = "12:00:01 learner INFO step 1/10  v1  reward 0.100\n"
    (logs / "learner.log").write_text(lines)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    watch = LearnerWatch(tmp_path, echo=True, bar=None)
    watch.poll()
    with open(logs / "learner.log", "a") as f:
        f.write("12:00:03 learner INFO step 2/10  v2  reward 0.200\n")
    watch.poll()
    watch.close()
    out = capsys.readouterr().out
    assert out == lines + "12:00:03 learner INFO step 2/10  v2  reward 0.200\n"


def test_on_a_terminal_rollctl_run_feeds_the_bar_only_new_metrics_rows(tmp_path):
    (tmp_path / "logs").mkdir()
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_row(7)) + "\n")  # an earlier learner's row: not shown again
    console = Console(record=True, force_terminal=True, width=120, file=io.StringIO())
    watch = LearnerWatch(tmp_path, echo=False, bar=StepProgress(10, console, redirect=False))
    watch.poll()
    with open(path, "a") as f:
        f.write(json.dumps(_row(8)) + "\n")
    watch.poll()
    watch.close()
    text = console.export_text()
    assert "step 8/10" in text and "step 7/10" not in text
