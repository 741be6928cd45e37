"""The learner's GPU-only options, checked on CPU where they cannot run: what each one hands to
torch or transformers (scripts/gpu_smoke.py runs them for real on a GPU).

- `trainer.compile` compiles every transformer block, and only those;
- `model.attn_implementation: flash_attention_2` reaches `from_pretrained`, and a packed forward
  then gives FlashAttention the restarts of the position ids, without the SDPA switch;
- host batches go to a CUDA device through pinned memory with a non-blocking copy, and stay as
  they are on the CPU.
"""

from dataclasses import dataclass
from unittest import mock

import torch

from rollflash.broker.config.config import load_config
from rollflash.learner.models.policy import load_policy
from rollflash.learner.process.device import batch_to_device, to_device
from rollflash.learner.step.packing import forward_packed, pack


def test_compile_compiles_each_transformer_block_and_nothing_else(tiny_model_dir):
    model, _ = load_policy(
        load_config(None, [f"model.path={tiny_model_dir}", "trainer.compile=true"])
    )
    compiled = [type(m).__name__ for m in model.modules() if m._compiled_call_impl is not None]
    assert compiled == ["Qwen2DecoderLayer"] * model.config.num_hidden_layers

    plain, _ = load_policy(load_config(None, [f"model.path={tiny_model_dir}"]))
    assert not any(m._compiled_call_impl is not None for m in plain.modules())


def test_flash_attention_2_reaches_from_pretrained(tiny_model_dir, monkeypatch):
    import transformers

    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(klass, path, *args, **kwargs):
        seen.append(kwargs["attn_implementation"])
        kwargs["attn_implementation"] = "eager"  # flash-attn is not installed on CPU
        return original(klass, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", "model.attn_implementation=flash_attention_2"]
    )
    load_policy(cfg)
    assert seen == ["flash_attention_2"]


def test_a_packed_forward_hands_flash_attention_the_position_restarts():
    model = mock.Mock()
    model.config._attn_implementation = "flash_attention_2"
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    forward_packed(model, pack(ids, torch.tensor([[1, 1, 1], [1, 1, 0]])))
    kwargs = model.call_args.kwargs
    assert model.config._attn_implementation == "flash_attention_2"  # not switched to sdpa_packed
    assert "cu_seq_lens_q" not in kwargs and "attention_mask" not in kwargs
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert kwargs["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and kwargs["use_cache"] is False


@dataclass
class _Batch:
    tokens: torch.Tensor
    mask: torch.Tensor
    size: int


def test_host_tensors_reach_cuda_pinned_and_without_blocking():
    cuda = torch.device("cuda", 0)
    t = mock.MagicMock(spec=torch.Tensor)
    to_device(t, cuda)
    t.pin_memory.assert_called_once_with()
    t.pin_memory.return_value.to.assert_called_once_with(cuda, non_blocking=True)

    batch = _Batch(mock.MagicMock(spec=torch.Tensor), mock.MagicMock(spec=torch.Tensor), 3)
    moved = batch_to_device(batch, cuda)
    assert moved.tokens is batch.tokens.pin_memory.return_value.to.return_value
    assert moved.mask is batch.mask.pin_memory.return_value.to.return_value
    assert moved.size == 3

    cpu = torch.device("cpu")
    host = torch.ones(2)
    assert to_device(host, cpu) is host and batch_to_device(batch, cpu) is batch
