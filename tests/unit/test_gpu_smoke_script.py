"""scripts/gpu_smoke_generate.py in its CPU smoke mode (`--device cpu --small`): one JSON line with
every figure the GPU run reports, and a log-probability match at float32 noise (the hf engine and
the learner's recomputation, same model, same dtype). The GPU figures themselves are unmeasured
here (docs/BENCHMARKS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_mode_prints_one_json_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke_generate.py"), "--device", "cpu"]
        + ["--small"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (line,) = out.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["device"] == "cpu" and result["gpu"] is None
    (tiny,) = result["models"].values()
    assert set(tiny["tok_s"]) == {"1", "4"} and all(v > 0 for v in tiny["tok_s"].values())
    assert tiny["dtype"] == "float32" and tiny["params"] > 0
    assert tiny["logprob_abs_diff_max"] < 1e-4  # same model and dtype: float32 noise at most
    assert tiny["reload_s"] >= tiny["verify_s"] >= 0 and tiny["swap_s"] >= 0


def test_cuda_without_a_gpu_is_refused_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke_generate.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 2
    assert "--device cuda: torch sees no GPU" in out.stderr.strip().splitlines()[-1]
