"""LoRA training (`model.lora`): the policy is the base model wrapped by `peft` with adapters.

    policy = with_adapters(base, cfg.model.lora)   # peft's get_peft_model: base frozen
    optimiser over trainable_parameters(policy)    # adapters (+ modules_to_save) only
    reference = AdaptersOffReference(policy)       # the base, adapters switched off: no copy
    published_weights(model, cfg)                  # adapter tensors + config, or merged weights

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") replaces the update
of a weight W [out, in] by (alpha / r) * B A with A [r, in] random and B [out, r] zero at start;
peft implements it, and its `get_delta_weight` gives the merged update. Only the adapters (and
`modules_to_save`, trained in full) have gradients, so only they have optimiser state.

A merged version (`trainer.publish: full`) is computed as W + delta outside the model: peft's
`merge_adapter` / `unmerge_adapter` would add and subtract the delta in place, and W + d - d is not
W in floating point, so the frozen base (and the reference, which is that base) would drift by a
rounding error at every publish.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from rollflash.learner.process.dist import Destination, full_state_dict, host_copies

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config
    from rollflash.broker.config.config_lora import LoRAConfig

ADAPTER = "default"  # peft's name for the one adapter the learner trains


def with_adapters(base: torch.nn.Module, lora: LoRAConfig) -> torch.nn.Module:
    """`base` wrapped by peft with fresh adapters (B = 0: the same function as `base`); the
    base's own parameters are frozen in place, so no copy of the weights is made."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; it only divides it
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config)


def peft_model(model: torch.nn.Module) -> Any:
    """The PeftModel inside `model` (DDP's `.module`), or None for a model without adapters
    (recognised without importing peft, which a full fine-tuning run never loads)."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "peft_config") and hasattr(inner, "get_base_model") else None


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimiser updates: all of a full model, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_config(model: Any, base_path: str) -> dict[str, Any]:
    """peft's adapter_config.json for `model`'s adapter (sets as sorted lists, as peft saves)."""
    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = base_path
    config["inference_mode"] = True
    return json.loads(json.dumps(config, default=sorted))


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names of a PEFT adapter file (adapter_model.safetensors),
    where they are (`published_weights` brings them to the host)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=ADAPTER))


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict, under its own names, with every adapter merged in
    (W + (alpha / r) B A) and `modules_to_save` replaced by their trained copies; the model's
    tensors are not changed (see the module docstring)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                # each LoraLayer subclass (Linear, Embedding, Conv) defines get_delta_weight
                deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER)  # type: ignore[attr-defined]
        out = {}
        for key, tensor in base.state_dict().items():
            parts = key.split(".")
            if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
                continue  # the adapters themselves; the untrained copy of a module to save
            name = key.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")
            out[name] = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
    return out


def published_weights(
    model: torch.nn.Module,
    cfg: Config,
    dtype: torch.dtype | None = None,
    into: Destination | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """What a weight version holds (`cfg.publish_kind`): the full state dict (merged for a LoRA
    policy) and None, or the adapter's tensors and its adapter_config.json; on the host, cast to
    `dtype` (`trainer.publish_dtype`), written straight into `into(layout)`'s tensors when given
    (learner/process/dist.py `host_copies`)."""
    lora = peft_model(model)
    if lora is None:
        return full_state_dict(model, dtype, into=into), None
    if cfg.publish_kind == "adapter":
        state = _once(adapter_state(lora))
        return host_copies(state, dtype, into), adapter_config(lora, cfg.model.path)
    return host_copies(_once(merged_state_dict(lora)), dtype, into), None


def _once(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Tied tensors (one storage under two names) once, under the first name, as
    `full_state_dict` keeps them."""
    seen: set[int] = set()
    out = []
    for name, t in state.items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append((name, t))
    return out
