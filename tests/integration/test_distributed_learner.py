"""Two gloo ranks under torchrun train to the same weights as one rank on the same batches
(issue 6): the loss shares are of the whole step, DDP averages gradients, and a rank with no
group this step still takes part. Runs tests/integration/dist_worker.py as real processes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def _train(model_dir, out, groups, nproc):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    proc = subprocess.run([*launch, str(WORKER), str(model_dir), str(out), str(groups)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out))


@pytest.mark.parametrize("groups", [5, 1], ids=["uneven-3-2", "one-rank-idle"])
def test_two_gloo_ranks_match_one_rank(tiny_model_dir, tmp_path, groups):
    one = _train(tiny_model_dir, tmp_path / "one.safetensors", groups, 1)
    two = _train(tiny_model_dir, tmp_path / "two.safetensors", groups, 2)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = 0
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, atol=1e-5, rtol=0)
        moved += name in start and not torch.equal(start[name], w)
    assert moved > 0  # the steps did change the weights
