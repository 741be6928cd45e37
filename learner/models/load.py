"""Building the learner's models on their devices without every rank reading the weights.

One rank: `from_pretrained`, then onto the device. Several ranks: every rank builds the model's
parameters on the meta device (no memory), rank 0 alone reads the weights into host memory, the
model is sharded (FSDP2 shards meta parameters) and materialised on the device, and rank 0's
tensors are broadcast into every rank's shards (`set_model_state_dict(broadcast_from_rank0)`),
one tensor at a time. At 7B on 8 ranks that is one host copy instead of eight.

Buffers that are not saved with the weights (rotary `inv_freq`) are computed by the module's
constructor, so parameters go on the meta device but buffers do not (`params_on_meta`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rollflash.learner.process.dist import Dist, tied_parameters
from rollflash.learner.models.lora import peft_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real. A
    parameter registered again under another name (a tie: `lm_head.weight =
    embed_tokens.weight`) is already on meta and is kept as the same object, so the tie holds."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        registered = self._parameters[name]
        if registered is not None and not registered.is_meta:
            meta = registered.to(torch.device("meta"))
            self._parameters[name] = type(registered)(meta, requires_grad=registered.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def retie(module: torch.nn.Module, ties: list[list[str]]) -> None:
    """Register the first parameter of each tie under its other names again."""
    for first, *others in ties:
        param = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = param


def materialise(module: torch.nn.Module, device: torch.device) -> None:
    """Meta parameters -> uninitialised ones on `device`; real buffers keep their values, and
    tied parameters stay one parameter (`to_empty` makes a new one per name)."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    ties = tied_parameters(module)
    module.to_empty(device=device)
    retie(module, ties)
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)


M = TypeVar("M", bound=torch.nn.Module)


def place(
    full: Callable[[], M],
    empty: Callable[[], M],
    dist: Dist,
    wrap: Callable[[M], torch.nn.Module] = lambda m: m,
    sharded: bool = False,
) -> torch.nn.Module:
    """The module on `dist.device`, wrapped: `full()` builds it with its weights (called on rank
    0 only when there are several ranks), `empty()` builds it with the same structure (called
    under `params_on_meta`). `sharded`: `wrap` shards (FSDP2), so it runs before the parameters
    are materialised and each rank only ever allocates its shard."""
    if dist.world_size == 1:
        return wrap(full().to(dist.device))
    weights = full().state_dict() if dist.is_main else {}
    with params_on_meta():
        built = empty()
    module = wrap(built) if sharded else built
    materialise(module, dist.device)
    set_model_state_dict(
        module,
        weights,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    del weights
    return module if sharded else wrap(built)


def check_tied(module: torch.nn.Module) -> None:
    """Raise if the model's config ties its output embedding to its input embedding
    (`tie_word_embeddings`) but the built module holds two parameters: training would then
    move one and publish the other. A LoRA policy is checked on its base; a head that peft
    replaced (`modules_to_save`) is trained apart by request and is not checked."""
    lora = peft_model(module)
    base = getattr(module, "module", module) if lora is None else lora.get_base_model()
    if not getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        return
    hf = cast("PreTrainedModel", base)  # a module whose config ties embeddings is a HF model
    out, inp = hf.get_output_embeddings(), hf.get_input_embeddings()
    if out is None or inp is None or "weight" not in out._parameters:
        return
    if out.weight is not inp.weight:
        raise RuntimeError(
            "model.path: the config ties the output embedding to the input embedding "
            "(tie_word_embeddings), but the learner built two parameters"
        )
