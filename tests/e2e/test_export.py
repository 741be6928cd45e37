"""`rollctl export` turns a published version into a directory transformers loads and generates with."""

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.weights import WeightStore


def test_export_round_trip(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # a version that differs from the base model
    WeightStore(run_dir).publish(model.state_dict(), version=3, step=3)
    out = tmp_path / "exported"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "export",
            "--set",
            f"run.run_dir={run_dir}",
            "--set",
            f"model.path={tiny_model_dir}",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    ids = tok(["12+7="], return_tensors="pt")
    gen = loaded.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def test_export_refuses_a_corrupt_version(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    store = WeightStore(run_dir)
    store.publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict(), 1, 1)
    f = store.version_dir(1) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10] + b"\x00" * 10)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "export",
            "--set",
            f"run.run_dir={run_dir}",
            "--set",
            f"model.path={tiny_model_dir}",
            "--version",
            "1",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "sha256 mismatch, refusing to load" in res.stderr
    assert not (tmp_path / "x").exists()
