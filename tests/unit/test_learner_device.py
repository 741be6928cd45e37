"""The learner's device, process group and precision (learner/process/device.py,
learner/process/dist.py), on CPU with torch.cuda's availability mocked: which device a rank takes,
which backend its group gets, that set_device comes before the group, and that bf16 compute over
fp32 masters stays close to fp32."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist
from transformers import AutoModelForCausalLM

from rollflash.broker.config.config import config_from_dict, load_config
from rollflash.broker.config.config_errors import ConfigError
from rollflash.learner.durability.publish import publish_dtype
from rollflash.learner.process import device as device_mod
from rollflash.learner.process import dist as dist_mod
from rollflash.learner.process.device import process_group_backend, resolve_device
from rollflash.learner.process.dist import Dist, compute_context, full_state_dict, init_dist
from rollflash.learner.step.logprobs import token_logprobs


@pytest.mark.parametrize(
    "setting, cuda, local_rank, expected",
    [
        ("auto", False, 0, "cpu"),
        ("auto", True, 3, "cuda:3"),
        ("cuda", True, 1, "cuda:1"),
        ("cpu", True, 2, "cpu"),
    ],
)
def test_device_resolution(monkeypatch, setting, cuda, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device(setting, local_rank) == torch.device(expected)
    assert process_group_backend(torch.device(expected)) == (
        "cpu:gloo,cuda:nccl" if expected.startswith("cuda") else "gloo"
    )


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^trainer.device: cuda, but torch sees no GPU"):
        resolve_device("cuda", 0)


def test_a_torchrun_rank_sets_its_device_before_joining_a_two_backend_group(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch_dist,
        "init_process_group",
        lambda b, device_id, timeout: calls.append((b, device_id, timeout)),
    )
    monkeypatch.setattr(torch_dist, "get_rank", lambda: 1)
    monkeypatch.setattr(torch_dist, "get_world_size", lambda: 2)
    monkeypatch.setattr("rollflash.broker.connect.redis_server.die_with_parent", lambda: None)
    d = init_dist("auto", timeout_s=45)
    cuda1 = torch.device("cuda", 1)
    # the timeout is passed: "cpu:gloo,cuda:nccl" would otherwise wait torch's 30 minutes
    assert calls == [("set_device", cuda1), ("cpu:gloo,cuda:nccl", cuda1, timedelta(seconds=45))]
    assert (d.rank, d.world_size, d.device, d.timeout_s) == (1, 2, cuda1, 45)


def test_one_process_on_cpu_joins_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch_dist, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    assert init_dist("auto") == Dist(0, 1, torch.device("cpu"))


def test_gpu_keys_are_not_hashed_and_publish_dtype_follows_model_dtype():
    base = load_config(None)
    keys = [
        "trainer.device=cpu",
        "trainer.gradient_checkpointing=true",
        "trainer.publish_dtype=bfloat16",
        "model.attn_implementation=eager",
    ]
    assert load_config(None, keys).fingerprint() == base.fingerprint()
    cpu = torch.device("cpu")
    assert publish_dtype(base, cpu) == torch.float32  # auto: model.dtype, float32 on CPU
    assert publish_dtype(load_config(None, ["model.dtype=bfloat16"]), cpu) == torch.bfloat16
    bf16 = load_config(None, ["trainer.publish_dtype=bfloat16"])
    assert publish_dtype(bf16, cpu) == torch.bfloat16


@pytest.mark.parametrize("cuda, expected", [(True, "bfloat16"), (False, "float32")])
def test_model_dtype_auto_is_bf16_on_a_gpu_and_fp32_on_cpu(monkeypatch, cuda, expected):
    """Each process resolves `model.dtype: auto` by its own device: the learner's rank (autocast,
    published weights), the hf engine and vLLM on CPU; the config keeps `auto`, so the
    fingerprint every process compares is the same whatever their devices."""
    from rollflash.generators.hf_engine import HFEngine
    from rollflash.generators.vllm_setup import llm_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = load_config(None)
    assert cfg.model.dtype == "auto"
    rank = resolve_device(cfg.trainer.device, 0)
    assert device_mod.resolved_dtype(cfg.model.dtype, rank) == expected
    assert publish_dtype(cfg, rank) == getattr(torch, expected)
    autocasts = []
    monkeypatch.setattr(torch, "autocast", lambda **kw: autocasts.append(kw))
    device_mod.autocast(rank, cfg.model.dtype)  # bf16 autocast on the GPU, none on CPU
    assert autocasts == ([{"device_type": "cuda", "dtype": torch.bfloat16}] if cuda else [])
    seen = {}
    monkeypatch.setattr(HFEngine, "__init__", lambda self, path, **kw: seen.update(kw))
    HFEngine.from_config(cfg, seed=0)
    assert seen["dtype"] == expected and seen["device"].type == ("cuda" if cuda else "cpu")
    assert llm_kwargs(cfg.rollout.vllm, cfg.model.dtype, 0, on_cpu=True)["dtype"] == "float32"
    assert llm_kwargs(cfg.rollout.vllm, cfg.model.dtype, 0, on_cpu=False)["dtype"] == "bfloat16"


@pytest.mark.parametrize("tf32, precision", [(True, "high"), (False, "highest")])
def test_tf32_is_set_on_a_gpu_only(monkeypatch, tf32, precision):
    set_to = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", set_to.append)
    device_mod.cuda_defaults(torch.device("cuda", 0), tf32)
    device_mod.cuda_defaults(torch.device("cpu"), tf32)
    assert set_to == [precision]


def test_bf16_autocast_over_fp32_masters_is_close_to_fp32(tiny_model_dir):
    """model.dtype bfloat16: parameters and gradients stay float32, the forward pass computes in
    bf16. Tolerance: bf16 keeps 8 mantissa bits (relative error 2^-8 = 0.4% per rounding); on the
    tiny model the log-probs (|logp| < 10) stay within 0.1 of float32, the gradients within 5%
    of their norm."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    results = []
    for dtype in ("float32", "bfloat16"):
        model.zero_grad()
        with compute_context(model, Dist(), dtype):
            logp, _ = token_logprobs(model, ids, mask, 1.0, chunk=8)
        logp.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logp.detach(), grads))
        assert logp.dtype == torch.float32
        assert all(
            p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
        )
    (l32, g32), (l16, g16) = results
    torch.testing.assert_close(l16, l32, atol=0.1, rtol=0)
    assert not torch.equal(l16, l32)  # bf16 did compute
    assert (g16 - g32).norm() <= 0.05 * g32.norm()


def test_full_state_dict_casts_dedups_tied_weights_and_copies_when_asked(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    out = full_state_dict(model, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert len(out) == len(model.state_dict()) - int(tied)
    same = full_state_dict(model)  # float32 on CPU: the parameters themselves, no copy
    name = next(iter(same))
    assert same[name].data_ptr() == model.state_dict()[name].data_ptr()


def test_batches_stay_put_on_cpu():
    t = torch.ones(2)
    assert device_mod.to_device(t, torch.device("cpu")) is t
    assert dist_mod.Dist().device == torch.device("cpu")


def test_config_rejects_an_unknown_attention_kernel():
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        config_from_dict({"model": {"attn_implementation": "flash"}})
