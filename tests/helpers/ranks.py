"""Running a test worker as N gloo ranks under torchrun (one process, without torchrun, for
N = 1), as real processes with this checkout on the path; the run must succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_ranks(nproc: int, worker: Path, *args: str, timeout: float = 240) -> None:
    launch = [*TORCHRUN, f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    proc = subprocess.run(
        [*launch, str(worker), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
