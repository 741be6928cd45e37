"""Where the learner computes and in what precision (`trainer.device`, `model.dtype`).

- Device: `trainer.device: auto` is cuda when torch sees a GPU, else cpu. Under torchrun each rank
  takes `cuda:LOCAL_RANK`; `cuda` without a GPU is a config error naming the key.
- Process group: one group with two backends, `cpu:gloo,cuda:nccl`, so the learner's small CPU
  collectives (counts, ids, metrics) keep running on gloo while tensors on the GPU go over NCCL.
- Precision (`model.dtype`): parameters and optimiser state stay float32 (the master copy) and
  `bfloat16` means the forward and backward passes compute in bf16 (`auto`: bf16 on a GPU,
  float32 on CPU, resolved by each rank's device): autocast for one rank and DDP,
  FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for `strategy: fsdp`. Frozen
  models (the reference) have no optimiser and are stored in `model.dtype` directly.
- A step's batch is built on the host and copied to the device once, pinned and `non_blocking`
  (learner/step/batch.py); everything the step computes from it stays there.
- On a GPU (`cuda_defaults`): TF32 for the float32 matmuls that remain (`trainer.tf32`), and
  `PYTORCH_CUDA_ALLOC_CONF` from `trainer.cuda_alloc_conf` unless the environment sets it
  (learner/process/launch.py sets it before torch allocates).
- Optimisers are AdamW with torch's fused kernel (`adamw`): one pass over every tensor instead of
  a Python loop over them, on CPU and GPU alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

import torch

from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_model import resolve_model_dtype

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Batch = TypeVar("Batch", bound="DataclassInstance")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(setting: str, local_rank: int | None = None) -> torch.device:
    """`trainer.device` -> this rank's device: auto | cpu | cuda; cuda is cuda:LOCAL_RANK."""
    if setting == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if setting == "cuda" and not available:
        raise ConfigError("trainer.device: cuda, but torch sees no GPU; set trainer.device: cpu")
    if not available:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """The backend string for `init_process_group`: gloo alone on CPU; with a GPU, gloo for CPU
    tensors and NCCL for CUDA ones, in one group."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def resolved_dtype(model_dtype: str, device: torch.device) -> str:
    """`model.dtype` on `device`: auto is bfloat16 on a GPU, float32 on CPU."""
    return resolve_model_dtype(model_dtype, device.type == "cuda")


def autocast(device: torch.device, model_dtype: str) -> AbstractContextManager:
    """bf16 autocast around a forward pass when `model.dtype` is bfloat16 (or auto on a GPU)
    and the module's parameters are float32 masters (one rank, DDP); a no-op for float32."""
    model_dtype = resolved_dtype(model_dtype, device)
    if model_dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[model_dtype])


def cuda_defaults(device: torch.device, tf32: bool) -> None:
    """On a GPU: TF32 tensor cores for float32 matmuls (`trainer.tf32`; 10 mantissa bits
    instead of 23 where bf16 autocast leaves float32, e.g. the critic's value head). Nothing on
    CPU, where "high" precision could pick reduced-precision kernels of its own."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either


def set_alloc_conf(setting: str, environ: dict[str, str] | None = None) -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF to `trainer.cuda_alloc_conf` unless the environment sets
    the allocator's configuration already (or `setting` is empty); call before the first CUDA
    allocation, which reads it. Returns what the allocator gets, for the start-up line."""
    env = os.environ if environ is None else environ
    for name in ALLOC_VARS:
        if name in env:
            return f"{name}={env[name]} (environment)"
    if not setting:
        return "torch's default allocator"
    env["PYTORCH_CUDA_ALLOC_CONF"] = setting
    return f"PYTORCH_CUDA_ALLOC_CONF={setting}"


def startup_line(cfg, rank: int, world: int, device: torch.device, policy, alloc: str) -> str:
    """The learner's settings as this rank resolved them (`rollctl config show` has the keys)."""
    trainer = cfg.trainer
    dtype = resolved_dtype(cfg.model.dtype, device)
    parts = [f"learner rank {rank}/{world} on {device}", f"model.dtype {dtype} ({cfg.model.dtype})"]
    if world > 1:
        fsdp = (
            f", reduce-scatter {trainer.fsdp_reduce_scatter}" if trainer.strategy == "fsdp" else ""
        )
        parts.append(
            f"strategy {trainer.strategy}{fsdp}, dist_timeout_s {trainer.dist_timeout_s:g}"
        )
    checkpointing = bool(getattr(policy, "is_gradient_checkpointing", False))
    parts.append(
        f"gradient checkpointing {'on' if checkpointing else 'off'} ({trainer.gradient_checkpointing})"
    )
    parts.append("non-finite updates skipped")  # learner/step/train.py: never stepped on
    if device.type == "cuda":
        parts.append(f"tf32 {'on' if trainer.tf32 else 'off'}, {alloc}")
    return "; ".join(parts)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and copied without blocking the host for a GPU."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def batch_to_device(batch: Batch, device: torch.device) -> Batch:
    """A dataclass of tensors (a step's Sequences, TurnInputs) with every tensor field, and
    every tensor of a mapping field, on `device`."""
    if device.type != "cuda":
        return batch
    moved = {f.name: _moved(getattr(batch, f.name), device) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **moved)


def _moved(value: object, device: torch.device) -> object:
    if isinstance(value, torch.Tensor):
        return to_device(value, device)
    if isinstance(value, Mapping):
        return MappingProxyType({k: _moved(v, device) for k, v in value.items()})
    return value


def adamw(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it runs (floating-point tensors on the CPU or a
    GPU, FSDP2's DTensor shards included): the same update as the per-tensor loop, in one pass
    over every tensor (docs/BENCHMARKS.md has the figures). Elsewhere torch's default
    implementation."""
    params = list(params)
    fused = bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
