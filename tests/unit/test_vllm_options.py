"""`rollout.vllm`: every key reaches `vllm.LLM` under vLLM's name, nulls resolve per device, and a
bad key or value is one line naming it. vLLM itself is not needed: the engine's `vllm.LLM` is
replaced by a class that records its arguments and stops the construction there
(tests/vllm_engine/test_vllm_engine.py checks the names against the real vLLM's EngineArgs)."""

from __future__ import annotations

import pytest

from rollflash.broker.config.config import ConfigError, config_from_dict

pytest.importorskip("transformers")

from rollflash.generators import vllm_engine, vllm_setup  # noqa: E402

EVERY_KEY = {
    "gpu_memory_utilization": 0.35,
    "tensor_parallel_size": 2,
    "max_model_len": 1536,
    "dtype": "float16",
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "max_num_seqs": 48,
    "max_num_batched_tokens": 4096,
    "seed": 1234,
    "kv_cache_memory_gb": 1.5,
}


class _Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """Build a VLLMEngine from a config and return the kwargs its vllm.LLM received."""
    calls: list[dict] = []

    class FakeLLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            raise _Captured

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    for name in vllm_setup.CPU_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(vllm_setup, "llm_class", lambda: FakeLLM)
    (tmp_path / "config.json").write_text("{}")

    def build(vllm: dict, on_cpu: bool, model_dtype: str = "float32") -> dict:
        monkeypatch.setattr(vllm_setup, "on_cpu", lambda: on_cpu)
        cfg = config_from_dict(
            {
                "model": {"path": str(tmp_path), "dtype": model_dtype},
                "rollout": {"engine": "vllm", "vllm": vllm},
            }
        )
        with pytest.raises(_Captured):
            vllm_engine.VLLMEngine.from_config(cfg, seed=77)
        return calls.pop()

    return build


def test_every_key_reaches_vllm_llm_under_its_vllm_name(captured, tmp_path):
    kwargs = captured(EVERY_KEY, on_cpu=False)
    expected = dict(EVERY_KEY)
    expected["kv_cache_memory_bytes"] = int(1.5 * 2**30)  # 1610612736: GiB -> bytes
    del expected["kv_cache_memory_gb"]
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["model"] == str(tmp_path)  # model.path
    # the settings the engine relies on are always there
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["generation_config"] == "vllm" and kwargs["async_scheduling"] is False
    assert kwargs["distributed_executor_backend"] is None  # vLLM picks uni / mp for TP on a GPU


def test_nulls_resolve_to_bf16_and_cuda_graphs_on_a_gpu(captured):
    kwargs = captured({}, on_cpu=False)
    assert kwargs["dtype"] == "bfloat16" and kwargs["enforce_eager"] is False
    assert kwargs["gpu_memory_utilization"] == 0.9 and kwargs["seed"] == 77
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["max_model_len"] is None
    assert kwargs["enable_prefix_caching"] is True
    assert not {"max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"} & set(kwargs)


def test_nulls_resolve_to_model_dtype_and_eager_on_cpu(captured):
    import os

    kwargs = captured({}, on_cpu=True, model_dtype="bfloat16")
    assert kwargs["dtype"] == "bfloat16" and kwargs["enforce_eager"] is True
    assert kwargs["gpu_memory_utilization"] == 0.1
    assert kwargs["distributed_executor_backend"] == "mp"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the CPU default KV cache, 1 GiB
    assert captured({}, on_cpu=True)["dtype"] == "float32"  # model.dtype's default


def test_kv_cache_from_config_is_not_overridden_by_the_cpu_default(captured, monkeypatch):
    import os

    kwargs = captured({"kv_cache_memory_gb": 2}, on_cpu=True)
    assert kwargs["kv_cache_memory_bytes"] == 2 * 2**30
    # vLLM's CPU backend lets $VLLM_CPU_KVCACHE_SPACE win, so the engine must not set it
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ


@pytest.mark.parametrize(
    "vllm, message",
    [
        (
            {"gpu_mem": 0.5},
            "rollout.vllm.gpu_mem: unknown key (known: dtype, enable_prefix_caching, "
            "enforce_eager, gpu_memory_utilization, kv_cache_memory_gb, max_model_len, "
            "max_num_batched_tokens, max_num_seqs, seed, tensor_parallel_size)",
        ),
        (
            {"gpu_memory_utilization": 1.2},
            "rollout.vllm.gpu_memory_utilization: must be in (0, 1] or null, got 1.2",
        ),
        ({"tensor_parallel_size": 0}, "rollout.vllm.tensor_parallel_size: must be >= 1, got 0"),
        (
            {"dtype": "fp8"},
            "rollout.vllm.dtype: must be one of ['auto', 'float32', 'bfloat16', 'float16'], "
            "got 'fp8'",
        ),
        ({"max_num_seqs": 2.5}, "rollout.vllm.max_num_seqs: expected an integer, got 2.5"),
        ({"enforce_eager": "yes"}, "rollout.vllm.enforce_eager: expected true or false, got 'yes'"),
        (
            {"kv_cache_memory_gb": 0},
            "rollout.vllm.kv_cache_memory_gb: must be > 0 or null, got 0.0",
        ),
    ],
)
def test_a_bad_vllm_key_or_value_is_one_line_naming_it(vllm, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"rollout": {"vllm": vllm}})
    assert str(e.value) == message


def test_device_keys_are_checked_and_not_fingerprinted():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"rollout": {"device": "gpu"}})
    assert str(e.value) == "rollout.device: must be one of ['auto', 'cpu', 'cuda'], got 'gpu'"
    base = config_from_dict({})
    local = config_from_dict(
        {"rollout": {"device": "cuda", "vllm": EVERY_KEY}, "placement": {"gpus": "0-3"}}
    )
    assert local.fingerprint() == base.fingerprint()  # how a process runs, not what it trains
    assert config_from_dict({"reward": {"dtype": "bfloat16"}}).fingerprint() != base.fingerprint()


def test_every_nested_field_has_a_description():
    from rollflash.broker.config.config import PlacementConfig, VLLMConfig

    for section in (VLLMConfig, PlacementConfig):
        for key, info in section.model_fields.items():
            assert info.description and "\n" not in info.description, key
