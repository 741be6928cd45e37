"""Two gloo ranks under torchrun train to the same weights as one rank on the same batches,
with DDP (full and LoRA) and with FSDP2: the loss shares are of the whole step, gradients are averaged
over the ranks, and a rank with less (or no) data this step still takes part in every collective.
Runs tests/integration/dist_worker.py as real processes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def _train(model_dir, out, groups, nproc, strategy="ddp"):
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    proc = subprocess.run(
        [*launch, str(WORKER), str(model_dir), str(out), str(groups), strategy],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out))


def _lora_matches(one: dict, two: dict) -> None:
    """LoRA adapters on q_proj and v_proj with a KL term against the base with the adapters
    off: the adapters two ranks train equal one rank's, and only the adapters are saved."""
    # 1 layer x (q_proj, v_proj) x (lora_A, lora_B): the checkpoint holds these 4 tensors only
    assert len(one) == 4 and all(".lora_A." in k or ".lora_B." in k for k in one)
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, atol=1e-5, rtol=0)
    assert all(one[k].abs().max() > 0 for k in one if ".lora_B." in k)  # B started at zero


@pytest.mark.parametrize(
    "strategy,groups",
    [("ddp+lora", 5), ("fsdp", 1)],
    ids=["ddp-uneven-3-2-and-lora", "fsdp-one-rank-idle"],
)
def test_two_gloo_ranks_match_one_rank(tiny_model_dir, tmp_path, strategy, groups):
    """The ddp case runs the same two-rank launch again with LoRA (dist_worker.py `ddp+lora`)."""
    lora = strategy.endswith("+lora")
    one = _train(tiny_model_dir, tmp_path / "one.safetensors", groups, 1, "ddp" + "+lora" * lora)
    two = _train(tiny_model_dir, tmp_path / "two.safetensors", groups, 2, strategy)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = 0
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, atol=1e-5, rtol=0)
        moved += name in start and not torch.equal(start[name], w)
    assert moved > 0  # the steps did change the weights
    if lora:
        _lora_matches(*[load_file(str(tmp_path / f"{n}.safetensors.lora")) for n in ("one", "two")])
