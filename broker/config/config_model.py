"""The `model:` section: the policy model, where it is read from, its dtype and prompt template,
and whether it is trained in full or through LoRA adapters (`model.lora`: broker/config/config_lora.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictStr

from rollflash.broker.config.config_base import Section
from rollflash.broker.config.config_lora import LoRAConfig


class ModelConfig(Section):
    path: StrictStr = Field(
        "models/tiny",
        description="a Hugging Face model directory, or a hub id read from the local hub cache "
        "(never downloaded: `huggingface-cli download ID` first)",
    )
    trust_remote_code: StrictBool = Field(
        False,
        description="let transformers and vLLM run the Python code a model directory ships "
        "(needed by some hub models; runs that code in every process)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="compute dtype: bfloat16 keeps float32 master weights and optimiser state "
        "in the learner and computes in bfloat16; generators load this dtype; auto: bfloat16 "
        "on a GPU, float32 on CPU (each process by its own device)",
    )
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = Field(
        "sdpa", description="the learner's attention kernel (flash_attention_2 needs a GPU)"
    )
    chat_template: StrictStr = Field(
        "auto",
        description="single-turn prompts: auto (the tokenizer's template if it has one), "
        "none (raw text), or a Jinja template file",
    )
    lora: LoRAConfig | None = Field(
        None, description="null: full fine-tuning; {rank, alpha, ...}: LoRA adapters (docs/lora.md)"
    )


def resolve_model_dtype(setting: str, on_cuda: bool) -> str:
    """`model.dtype` for a process computing on a GPU (`on_cuda`) or the CPU: auto is bfloat16
    on a GPU (bf16 tensor cores, half the activation memory) and float32 on CPU (no bf16 matmul
    kernels worth the precision there)."""
    if setting != "auto":
        return setting
    return "bfloat16" if on_cuda else "float32"
