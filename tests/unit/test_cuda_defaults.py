"""The learner's GPU-sized defaults, on CPU with the GPU's properties mocked: gradient
checkpointing `auto` decides from learner/models/memory.py's estimate (hand-computed below for
Qwen2.5-0.5B's shapes), the allocator setting yields to the environment, and the start-up line
shows what the rank resolved."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rollflash.broker.config.config import load_config
from rollflash.learner.models import memory
from rollflash.learner.models.policy import load_policy
from rollflash.learner.process.device import set_alloc_conf, startup_line

GIB = 2**30
QWEN05 = Qwen2Config(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip
CUDA = torch.device("cuda", 0)


def _gpu(monkeypatch, gib: float) -> None:
    props = SimpleNamespace(total_memory=int(gib * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def _meta_qwen():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(QWEN05)


def test_the_estimate_for_qwen05_at_16_rows_of_2048_tokens(monkeypatch):
    # tokens = micro_batch_size 16 x (prompt 1024 + response 1024) = 32768; bf16 (auto on a GPU)
    # per token and layer: 16h + 2 (5h + 3 h_kv + 4I) = 14336 + 2 (4480 + 384 + 19456) = 62976 B
    # layers: 24 x 62976 x 32768 = 49.53e9 B; logits 32768 x 151936 x 2 = 9.957e9 B, plus the
    # float32 log-softmax of 1024 positions: 1024 x 151936 x 8 = 1.245e9 B -> 60.73e9 B = 56.56 GiB
    # checkpointed: 32768 x (4h x 24 + 62976) = 4.882e9 B + logits 11.20e9 B = 14.98 GiB
    # states: 494,032,768 parameters x 16 B (one rank: weights, gradient, AdamW) = 7.36 GiB
    _gpu(monkeypatch, 40)
    cfg = load_config(None, ["trainer.micro_batch_size=16", "rollout.max_new_tokens=1024"])
    model = _meta_qwen()
    params = sum(p.numel() for p in model.parameters())
    assert params == 494_032_768
    est = memory.estimate(cfg, QWEN05, params, 1, CUDA)
    assert est.activations_gib == pytest.approx(56.56, abs=0.01)
    assert est.checkpointed_gib == pytest.approx(14.98, abs=0.01)
    assert est.states_gib == pytest.approx(7.36, abs=0.01)
    assert not est.fits  # 63.9 GiB > 0.9 x 40 = 36 GiB


@pytest.mark.parametrize(
    "gib, setting, world, on",
    [
        (40, "auto", 1, True),  # 63.9 GiB > 36 GiB
        (80, "auto", 1, False),  # 63.9 GiB <= 72 GiB
        (40, False, 1, False),  # as set
        (80, True, 1, True),
        # FSDP over 8 ranks: states 7.36 / 8 = 0.92 GiB; 56.56 + 0.92 = 57.5 GiB <= 0.9 x 64 = 57.6
        (64, "auto", 8, False),
    ],
)
def test_auto_turns_checkpointing_on_when_activations_do_not_fit(
    monkeypatch, gib, setting, world, on
):
    _gpu(monkeypatch, gib)
    cfg = load_config(
        None,
        [
            "trainer.micro_batch_size=16",
            "rollout.max_new_tokens=1024",
            f"trainer.gradient_checkpointing={str(setting).lower()}",
            "trainer.strategy=fsdp",
        ],
    )
    assert memory.use_checkpointing(cfg, _meta_qwen(), QWEN05, world, CUDA) is on


def test_auto_warns_when_even_checkpointed_it_may_not_fit(monkeypatch, caplog):
    # 16 GiB: usable 0.9 x 16 = 14.4 GiB < states 7.36 + checkpointed 14.98 = 22.34 GiB
    cfg = load_config(None, ["trainer.micro_batch_size=16", "rollout.max_new_tokens=1024"])
    for gib, warned in ((16, True), (40, False)):  # 40: 22.34 <= 36, checkpointing suffices
        _gpu(monkeypatch, gib)
        caplog.clear()
        with caplog.at_level("INFO", logger="rollflash.learner.models.memory"):
            assert memory.use_checkpointing(cfg, _meta_qwen(), QWEN05, 1, CUDA)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(warnings) is warned, (gib, warnings)
        if warned:
            assert "even with gradient checkpointing" in warnings[0]
            assert "trainer.micro_batch_size" in warnings[0]


def test_auto_is_off_on_cpu_and_the_learner_builds_it_so(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    assert cfg.trainer.gradient_checkpointing == "auto"
    model, _ = load_policy(cfg)
    assert not model.is_gradient_checkpointing
    on, _ = load_policy(
        load_config(None, [f"model.path={tiny_model_dir}", "trainer.gradient_checkpointing=true"])
    )
    assert on.is_gradient_checkpointing
    line = startup_line(cfg, 0, 1, torch.device("cpu"), on, "unused")
    assert (
        line
        == "learner rank 0/1 on cpu; model.dtype float32 (auto); gradient checkpointing on (auto); "
        "non-finite updates skipped"
    )


def test_the_allocator_setting_yields_to_the_environment():
    env: dict[str, str] = {}
    assert (
        set_alloc_conf("expandable_segments:True", env)
        == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    assert set_alloc_conf("expandable_segments:True", mine).endswith("(environment)")
    assert mine == {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    none: dict[str, str] = {}
    assert set_alloc_conf("", none) == "torch's default allocator" and none == {}


def test_the_startup_line_of_a_gpu_rank_shows_every_gpu_default():
    cfg = load_config(None, ["trainer.strategy=fsdp"])
    line = startup_line(
        cfg,
        1,
        8,
        CUDA,
        SimpleNamespace(is_gradient_checkpointing=True),
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    assert line == (
        "learner rank 1/8 on cuda:0; model.dtype bfloat16 (auto); strategy fsdp, reduce-scatter "
        "every_micro_batch, dist_timeout_s 600; gradient checkpointing on (auto); non-finite "
        "updates skipped; tf32 on, "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
