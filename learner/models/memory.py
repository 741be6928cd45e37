"""Whether a learner rank's training fits its GPU: the estimate behind `trainer.gradient_checkpointing:
auto` (docs/gpu.md has the per-parameter figures).

Model states, bytes per parameter on each rank (float32 masters, AdamW):
- one rank: 4 (weights) + 4 (gradient) + 8 (AdamW's two moments) = 16;
- DDP: 16 + 4 (the gradient buckets DDP all-reduces, a copy of the gradient) = 20;
- FSDP over N ranks: 16 / N, plus 4 more with `fsdp_reduce_scatter: last_micro_batch` (the
  unsharded float32 gradient FSDP accumulates between reduce-scatters).
A frozen reference (`algo.kl_coef` > 0) adds 2 (bf16) or 4 bytes, / N under FSDP. LoRA: 4 (the
frozen float32 base), the adapters being small.

Activations of one micro-batch, bytes per token and decoder layer: what autograd keeps for the
backward pass of a Llama/Qwen2 block under bf16 autocast over float32 masters (hidden size h,
key/value width h_kv, MLP width I). In bf16: the inputs of the q/k/v, o, gate/up and down
projections (3h + I), rotary's q and k (h + h_kv), attention's q, k and v (h + 2 h_kv), the gate
and up outputs and SiLU's (3I): 2 x (5h + 3 h_kv + 4I) bytes. In float32: the two RMSNorms'
input and normalised output (4 x 4h). Fused attention (SDPA, FlashAttention) keeps no [T, T]
scores. This is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4.1), whose 34h for a GPT block becomes 26h + 6 h_kv + 8I for a gated MLP with
grouped KV heads (Qwen2.5-7B: 248 kB a token and layer). Float32 compute doubles the bf16 terms.
The logits add T x V x 2 bytes (bf16), and the float32 log-softmax 8 bytes a vocabulary entry for
`trainer.logprob_chunk` positions at a time. With checkpointing a layer keeps only its float32
input (4h), and one layer is recomputed at a time.

A micro-batch holds `trainer.token_budget` tokens, or `micro_batch_size` rows of the prompt and
the response budget, the prompt taken as long as `rollout.max_new_tokens` (the learner does not
know the prompts when it starts): an over-estimate for short prompts. Checkpointing goes on
when states plus activations exceed 90% of the GPU's memory (the rest is the allocator's slack
and the kernels' workspaces).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rollflash.broker.config.config import Config
from rollflash.learner.process.device import resolved_dtype

log = logging.getLogger(__name__)

GIB = 2**30
USABLE = 0.9  # share of the GPU's memory the estimate may fill


@dataclass(frozen=True)
class MemoryEstimate:
    states_gib: float  # weights, gradients, optimiser state (and the reference) on one rank
    activations_gib: float  # one micro-batch's, without checkpointing
    checkpointed_gib: float  # the same with gradient checkpointing
    device_gib: float  # the GPU's memory

    @property
    def fits(self) -> bool:
        return self.states_gib + self.activations_gib <= USABLE * self.device_gib

    def describe(self) -> str:
        return (
            f"{self.states_gib:.1f} GiB of weights and optimiser state + {self.activations_gib:.1f}"
            f" GiB of activations ({self.checkpointed_gib:.1f} checkpointed) vs {USABLE:.0%} of "
            f"{self.device_gib:.0f} GiB"
        )


def micro_batch_tokens(cfg: Config) -> int:
    """Tokens of one forward/backward pass (module docstring)."""
    trainer = cfg.trainer
    if trainer.token_budget > 0:
        return trainer.token_budget
    return trainer.micro_batch_size * 2 * cfg.rollout.max_new_tokens


def state_bytes_per_param(cfg: Config, world_size: int) -> float:
    trainer, sharded = cfg.trainer, cfg.trainer.strategy == "fsdp" and world_size > 1
    if cfg.model.lora is not None:
        return 4.0  # the frozen float32 base; the adapters and their state are small
    if not sharded:
        per = 20.0 if world_size > 1 else 16.0
    else:
        per = 16.0 / world_size + (
            4.0 if trainer.fsdp_reduce_scatter == "last_micro_batch" else 0.0
        )
    if cfg.algo.kl_coef > 0 and cfg.model.lora is None:
        ref = 4.0 if cfg.model.dtype == "float32" else 2.0
        per += ref / world_size if sharded else ref
    return per


def estimate(
    cfg: Config, model_config, params: int, world_size: int, device: torch.device
) -> MemoryEstimate:
    """The estimate of the module docstring for a model of `params` parameters whose Hugging
    Face config is `model_config`, on `device` (a GPU)."""
    h, layers = model_config.hidden_size, model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    h_kv = h * kv // heads
    inner = getattr(model_config, "intermediate_size", None) or 4 * h
    tokens = micro_batch_tokens(cfg)
    bf16 = resolved_dtype(cfg.model.dtype, device) == "bfloat16"
    low = 2 * (5 * h + 3 * h_kv + 4 * inner)  # the bf16 terms (module docstring)
    per_layer = 16 * h + (low if bf16 else 2 * low)  # bytes per token
    chunk = min(tokens, cfg.trainer.logprob_chunk or tokens)
    vocab = model_config.vocab_size
    logits = tokens * vocab * (2 if bf16 else 4) + chunk * vocab * 8
    full = tokens * per_layer * layers + logits
    checkpointed = tokens * (4 * h * layers + per_layer) + logits
    total = torch.cuda.get_device_properties(device).total_memory
    return MemoryEstimate(
        states_gib=params * state_bytes_per_param(cfg, world_size) / GIB,
        activations_gib=full / GIB,
        checkpointed_gib=checkpointed / GIB,
        device_gib=total / GIB,
    )


def use_checkpointing(
    cfg: Config, module: torch.nn.Module, model_config, world_size: int, device: torch.device
) -> bool:
    """`trainer.gradient_checkpointing` for `module` (the policy, or the critic's backbone):
    true or false as set; auto: on a GPU, on when the estimate does not fit (logged either
    way); off on CPU."""
    setting = cfg.trainer.gradient_checkpointing
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return False
    params = sum(p.numel() for p in module.parameters())
    est = estimate(cfg, model_config, params, world_size, device)
    log.info(
        "gradient checkpointing %s (auto): %s",
        "off" if est.fits else "on",
        est.describe(),
    )
    if not est.fits and est.states_gib + est.checkpointed_gib > USABLE * est.device_gib:
        log.warning(
            "even with gradient checkpointing a micro-batch may not fit (%s): lower "
            "trainer.micro_batch_size / token_budget, or shard with strategy: fsdp",
            est.describe(),
        )
    return not est.fits
