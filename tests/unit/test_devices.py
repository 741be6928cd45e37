"""`rollout.device` and `reward.dtype` (generators/device.py): what the hf engine and the
reward-model scorer are built with, on a CPU machine with torch.cuda.is_available mocked. Only the
arguments are checked; nothing runs on a GPU here (that path is unmeasured, docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from rollflash.broker.config.config import ConfigError, config_from_dict
from rollflash.envs import make_task
from rollflash.generators import hf_engine, rewarder
from rollflash.generators.device import resolve_device, resolve_dtype


@pytest.mark.parametrize(
    "setting, cuda, expected",
    [
        ("auto", True, torch.device("cuda", 0)),
        ("auto", False, torch.device("cpu")),
        ("cpu", True, torch.device("cpu")),
        ("cuda", True, torch.device("cuda", 0)),
    ],
)
def test_resolve_device(monkeypatch, setting, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device(setting) == expected


def test_cuda_without_a_gpu_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda")
    assert str(e.value).startswith("rollout.device: cuda, but torch sees no GPU (")
    assert "CUDA_VISIBLE_DEVICES=3" in str(e.value) and "\n" not in str(e.value)


def test_resolve_dtype():
    assert resolve_dtype("auto", "float32") == "float32"
    assert resolve_dtype("bfloat16", "float32") == "bfloat16"


@pytest.mark.parametrize("cuda, device", [(True, "cuda:0"), (False, "cpu")])
def test_hf_engine_is_built_on_the_resolved_device(monkeypatch, cuda, device):
    built = []

    class Captured(hf_engine.HFEngine):
        def __init__(self, model_path, dtype="float32", device="cpu", trust_remote_code=False):
            built.append((model_path, dtype, str(device)))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = config_from_dict({"model": {"path": "m", "dtype": "bfloat16"}})
    Captured.from_config(cfg, seed=0)
    assert built == [("m", "bfloat16", device)]


@pytest.mark.parametrize(
    "rollout_device, reward_dtype, cuda, expected",
    [
        # dtype follows model.dtype, whose auto is bf16 on a GPU and float32 on CPU
        ("auto", "auto", True, ("bfloat16", "cuda:0")),
        ("auto", "auto", False, ("float32", "cpu")),
        ("auto", "bfloat16", False, ("bfloat16", "cpu")),
        ("cpu", "bfloat16", True, ("bfloat16", "cpu")),
    ],
)
def test_reward_model_scorer_gets_its_own_dtype_and_the_rollout_device(
    monkeypatch, rollout_device, reward_dtype, cuda, expected
):
    built = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(
        rewarder,
        "RewardModelScorer",
        lambda path, dtype, mbs, max_len, device: built.append((dtype, str(device))),
    )
    cfg = config_from_dict(
        {
            "rollout": {"device": rollout_device},
            "reward": {"type": "model", "model_path": "rm", "dtype": reward_dtype},
        }
    )
    rewarder.make_rewarder(cfg, make_task("arithmetic", {}))
    assert built == [expected]


def test_hf_engine_runs_on_an_explicit_cpu_device(tiny_model_dir):
    from rollflash.generators.sampling import SamplingParams

    engine = hf_engine.HFEngine(str(tiny_model_dir), device="cpu")
    assert next(engine.model.parameters()).device == torch.device("cpu")
    (group,) = engine.generate(["1+2="], SamplingParams(2, 1.0, 1.0, 4))
    assert len(group) == 2 and all(len(s.logprobs) == len(s.response_ids) for s in group)
