"""`rollctl plot`'s reading of metrics.jsonl, by hand, and a report drawn from a synthetic run."""

import json

import pytest

from rollflash.learner.metrics.lengths import FATES
from rollflash.rollctl.plot import PANELS, PlotError, load_run, render, smooth


def _write(run_dir, rows, summary=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_load_run_keeps_the_last_row_of_a_step_and_skips_nulls(tmp_path):
    # steps 1, 2, 3, then a resume from the checkpoint of step 1 logs steps 2 and 3 again
    rows = [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2, "loss/policy": None},
        {"step": 3, "reward/mean": 0.3},
        {"step": 2, "reward/mean": 0.25},
        {"step": 3, "reward/mean": 0.35, "eval/heldout_acc": 0.5},
    ]
    _write(tmp_path / "a", rows, {"heldout_acc_before": 0.2})
    run = load_run(tmp_path / "a")
    assert run.name == "a" and run.steps == [1, 2, 3]
    assert run.get("reward/mean") == ([1, 2, 3], [0.1, 0.25, 0.35])
    assert run.get("loss/policy") == ([], [])
    assert run.get("eval/heldout_acc") == ([3], [0.5])
    assert run.summary == {"heldout_acc_before": 0.2}


def test_load_run_names_a_directory_without_metrics(tmp_path):
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        load_run(tmp_path)
    _write(tmp_path / "empty", [])
    with pytest.raises(PlotError, match="no steps logged yet"):
        load_run(tmp_path / "empty")


def test_smooth_is_a_trailing_mean():
    # window 2: [1], [1, 3], [3, 5], [5, 7] -> 1, 2, 4, 6
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 3.0], 1) == [1.0, 3.0]


def _rows(steps, lift):
    return [
        {
            "step": s,
            "reward/mean": lift * s,
            "length/trained_mean": 5.0,
            "length/completed_mean": 5.5,
            "length/stale_mean": 9.0 if s % 4 == 0 else None,  # only steps that drop any
            "async/staleness_hist/0": 1,
            "async/staleness_hist/1": 3,
            "async/staleness_mean": 0.75,
            "async/staleness_max": 1,
        }
        for s in range(1, steps + 1)
    ]


def test_render_writes_a_png_and_names_the_panels_nobody_logged(tmp_path):
    pytest.importorskip(
        "matplotlib", reason="the plot extra is not installed: pip install -e .[plot]"
    )
    from PIL import Image

    _write(tmp_path / "a0", _rows(10, 0.01))
    _write(tmp_path / "a1", _rows(8, 0.02))
    report = render([tmp_path / "a0", tmp_path / "a1"], tmp_path / "out" / "r.png")
    assert report.path == tmp_path / "out" / "r.png"
    with Image.open(report.path) as im:
        assert im.format == "PNG" and im.size == (1200, 880)  # 15 x 11 inches at 80 dpi
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 50
    assert report.empty_panels == ["eval", "kl", "wait", "speed", "loss", "clip"]
    assert {name for name, _ in PANELS} >= set(report.empty_panels)
    # the length panel shows the length bias: trained, completed and stale means of each run
    assert report.legends["length"] == [
        f"{run} length/{fate}_mean" for run in ("a0", "a1") for fate in FATES
    ]
