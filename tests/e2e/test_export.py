"""`rollctl export` turns a published version into a directory transformers loads and generates with."""

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.weights.weights import WeightStore


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
    assert "sha256 mismatch in model.safetensors" in res.stderr and "refusing to load" in res.stderr
    assert not (tmp_path / "x").exists()


def _export(run_dir, model_dir, out, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "export",
            "--set",
            f"run.run_dir={run_dir}",
            "--set",
            f"model.path={model_dir}",
            "--set",
            "model.lora={rank: 4, target_modules: [q_proj]}",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_adapter_version_exports_as_a_peft_adapter_and_merged(tmp_path, tiny_model_dir):
    from peft import PeftModel

    from rollflash.broker.config.config import config_from_dict
    from rollflash.learner.models.lora import published_weights, with_adapters

    cfg = config_from_dict(
        {
            "run": {"run_dir": str(tmp_path / "run")},
            "model": {
                "path": str(tiny_model_dir),
                "lora": {"rank": 4, "target_modules": ["q_proj"]},
            },
        }
    )
    policy = with_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg.model.lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)  # an adapter that changes the model
    tensors, config = published_weights(policy, cfg)
    WeightStore(tmp_path / "run").publish(tensors, 2, 2, adapter_config=config)
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(["12+7="], return_tensors="pt")
    with torch.no_grad():
        expected = policy.eval()(**ids).logits
    from rollflash.learner.tools.export import export_version  # in-process: the CLI is tested below

    export_version(cfg, None, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    res = _export(tmp_path / "run", tiny_model_dir, tmp_path / "merged", "--merge")
    assert res.returncode == 0, res.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    for model in (adapter, merged):
        with torch.no_grad():
            torch.testing.assert_close(model(**ids).logits, expected, atol=1e-5, rtol=0)
        gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
        assert gen.shape[1] > ids["input_ids"].shape[1]


def test_a_version_stored_as_a_delta_exports_whole(tmp_path, tiny_model_dir, learner_broker):
    """The publisher stores v2 as a delta against v1 (weights.anchor_every 10, a few elements
    changed); `rollctl export` rebuilds it from its anchor, verified, and writes it whole."""
    from rollflash.broker.config.config import load_config
    from rollflash.learner.durability.publish_process import NewVersion, VersionWriter

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.run_dir={run_dir}", "weights.anchor_every=10"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    writer = VersionWriter(cfg, learner_broker)
    try:
        writer.write(model.state_dict(), NewVersion(1, 1))  # written out before it changes
        with torch.no_grad():
            for p in model.parameters():
                p.view(-1)[:3].add_(0.01)  # 3 elements of each tensor change
        writer.write(model.state_dict(), NewVersion(2, 2))
        assert writer.store.manifest(2).kind == "delta"
    finally:
        writer.close()
    out = tmp_path / "exported"
    res = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "export", "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={tiny_model_dir}", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
