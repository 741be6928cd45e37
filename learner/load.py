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

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rollflash.learner.dist import Dist


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            kind = type(self._parameters[name])
            meta = self._parameters[name].to(torch.device("meta"))
            self._parameters[name] = kind(meta, requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialise(module: torch.nn.Module, device: torch.device) -> None:
    """Meta parameters -> uninitialised ones on `device`; real buffers keep their values."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)


def place(
    full: Callable[[], torch.nn.Module],
    empty: Callable[[], torch.nn.Module],
    dist: Dist,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m,
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
        module = empty()
    if sharded:
        module = wrap(module)
    materialise(module, dist.device)
    set_model_state_dict(
        module,
        weights,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    del weights
    if not sharded:
        module = wrap(module)
    return module
