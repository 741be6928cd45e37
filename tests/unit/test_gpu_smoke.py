"""scripts/gpu_smoke.py's CPU path runs and passes its own checks (the GPU figures need a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_cpu_path_reports_every_check_passed():
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_smoke.py",
            "--device",
            "cpu",
            "--small",
            "--strategies",
            "single",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["cases"]) == {"single", "single-packed"}
    assert report["ok"] is True and report["bf16_vs_cpu_fp32"] > 0  # bf16 did compute
    for case in report["cases"].values():
        assert case["masters_fp32"] and case["loss_finite"] and case["published_greedy_match"]
        assert case["resume_max_diff"] <= 1e-5
