"""The learner's ranks: who this process is and how the ranks agree.

`rollctl start-learner --nproc N` runs N copies of the learner under torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; one process without them is rank 0 of 1 and
never touches torch.distributed. On CPU the group is gloo; on GPUs each rank first takes
cuda:LOCAL_RANK, then joins one group with gloo for CPU tensors and NCCL for CUDA tensors
(learner/process/device.py), so the small CPU collectives here (counts, ids, metrics) keep working.

Every collective and barrier waits at most `trainer.dist_timeout_s` (the process group's timeout,
for gloo and NCCL alike); a rank whose peer stalled or died then ends with one line naming itself
and the operation (`CollectiveTimeout`) instead of waiting forever. NCCL's watchdog reports its
own collectives' timeouts in the same terms ("[Rank r] ... OpType=ALLREDUCE ... timing out").

Rank 0 is the only rank that issues prompts, publishes weights and writes the checkpoint's model
files; every rank reads trajectories as its own consumer `rank{r}` of the learner group and
acknowledges only its own entries.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from rollflash.errors import RollflashError
from rollflash.learner.process.device import (
    DTYPES,
    autocast,
    process_group_backend,
    resolve_device,
    resolved_dtype,
)

# how torch's backends word a wait that ended because a peer stalled or went away
_PEER_TROUBLE = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


class CollectiveTimeout(RollflashError, TimeoutError):
    """A collective this rank waited in ended because another rank stalled or died."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # where this rank's models and batches live
    timeout_s: float = 600.0  # trainer.dist_timeout_s: how long a collective may wait

    @contextmanager
    def waiting(self, operation: str) -> Iterator[None]:
        """Name `operation` in the one-line error of a collective inside that timed out or lost
        its peer (torch raises a RuntimeError that names neither the rank nor the operation)."""
        try:
            yield
        except RuntimeError as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.world_size == 1 or not any(w in cause.lower() for w in _PEER_TROUBLE):
                raise
            raise CollectiveTimeout(
                f"rank {self.rank} of {self.world_size}: {operation} ended after waiting for "
                f"the other ranks (trainer.dist_timeout_s = {self.timeout_s:g} s): another "
                f"rank stalled or died ({cause.rpartition('] ')[2]})"
            ) from None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def consumer(self) -> str:
        """This rank's stable consumer name in the learner group."""
        return f"rank{self.rank}"

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small, msgpack-able values), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.waiting("all_gather_object (Dist.gather)"):
            torch_dist.all_gather_object(out, obj)
        return out

    def sum(self, value: float) -> float:
        return self.sums([value])[0]

    def sums(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (float64, one collective on the CPU group)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        with self.waiting("all_reduce (Dist.sums)"):
            torch_dist.all_reduce(t)
        return t.tolist()

    def barrier(self, operation: str = "barrier") -> None:
        if self.world_size > 1:
            with self.waiting(operation):
                torch_dist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and torch_dist.is_initialized():
            self.barrier("barrier before shutdown")  # an early teardown can hang the others
            torch_dist.destroy_process_group()


def init_dist(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join the process group torchrun describes in the environment, if any, on this rank's
    device (`trainer.device`: auto | cpu | cuda, learner/process/device.py), every collective waiting
    at most `timeout_s` (`trainer.dist_timeout_s`)."""
    dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before the group: NCCL binds the current device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=dev, timeout_s=timeout_s)
    from rollflash.broker.connect.redis_server import die_with_parent

    die_with_parent()  # a rank must not outlive torchrun's agent (kill -9 of the learner)
    if not torch_dist.is_initialized():
        # the timeout is explicit: the two-backend string would get torch's generic 30 minutes
        torch_dist.init_process_group(
            process_group_backend(dev),
            device_id=dev if dev.type == "cuda" else None,
            timeout=timedelta(seconds=timeout_s),
        )
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    return Dist(rank=rank, world_size=world, device=dev, timeout_s=timeout_s)


def split_quotas(counts: list[int], total: int, first: list[int] | None = None) -> list[int]:
    """How many of its ready groups each rank trains so that the ranks together train `total`:
    each rank's `first` groups before any other (the groups that would be too old for the next
    step), then as even as the counts allow; rank order breaks ties, never more than a rank holds.

    counts [5, 0] total 4 -> [4, 0];  counts [3, 3] total 4 -> [2, 2];  [1, 9] total 4 -> [1, 3]
    counts [3, 3] total 4, first [0, 3] -> [1, 3];  first [3, 3] -> [2, 2]
    """
    quotas = [0] * len(counts)
    left = min(total, sum(counts))
    first = first or [0] * len(counts)
    for limits in ([min(f, c) for f, c in zip(first, counts, strict=True)], counts):
        open_ = [r for r in range(len(limits)) if quotas[r] < limits[r]]
        while left > 0 and open_:
            r = min(open_, key=lambda r: (quotas[r], r))
            quotas[r] += 1
            left -= 1
            if quotas[r] == limits[r]:
                open_.remove(r)
    return quotas


def wrap_model(
    policy: torch.nn.Module, dist: Dist, strategy: str, model_dtype: str = "float32"
) -> torch.nn.Module:
    """The module the ranks train: the policy itself on one rank; DistributedDataParallel
    (`ddp`: a full replica per rank, gradients all-reduced); or FSDP2 (`fsdp`, `shard`)."""
    if dist.world_size == 1:
        return policy
    model_dtype = resolved_dtype(model_dtype, dist.device)
    if strategy == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DistributedDataParallel(policy, device_ids=ids)
    return shard(policy, model_dtype)


def shard(module: torch.nn.Module, model_dtype: str = "float32") -> torch.nn.Module:
    """FSDP2: `fully_shard` on every transformer block, then on the whole module, so parameters,
    gradients and optimiser state are sharded over the ranks; shards in place (also on the meta
    device) and returns the same object. With float32 parameters and `model.dtype: bfloat16` the
    blocks compute in bf16 and reduce gradients in fp32 (`MixedPrecisionPolicy`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    params = next(module.parameters()).dtype
    mp = MixedPrecisionPolicy()
    if model_dtype != "float32" and params == torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[model_dtype], reduce_dtype=torch.float32)
    inner = getattr(module, "backbone", module)  # the critic: its body names the blocks
    blocks = set(getattr(inner, "_no_split_modules", None) or [])
    for m in module.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, mp_policy=mp)
    head = getattr(module, "value_head", None)
    if isinstance(head, torch.nn.Module):
        fully_shard(head)  # the critic's head computes in float32
    fully_shard(module, mp_policy=mp)
    return module


def compute_context(
    model: torch.nn.Module | None, dist: Dist, model_dtype: str
) -> AbstractContextManager:
    """The context of a forward pass: bf16 autocast over float32 masters with `model.dtype:
    bfloat16` (one rank, DDP); nothing for FSDP, whose MixedPrecisionPolicy casts already."""
    if model is not None and is_sharded(model):
        return nullcontext()
    return autocast(dist.device, model_dtype)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
Destination = Callable[[Layout], dict[str, torch.Tensor]]


def tied_parameters(module: torch.nn.Module) -> list[list[str]]:
    """Names of the parameters that are one object registered under several names (a tied
    embedding: [['model.embed_tokens.weight', 'lm_head.weight']]), one list per object."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def full_state_dict(
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    into: Destination | None = None,
) -> dict[str, torch.Tensor]:
    """The whole model's weights on the host, cast to `dtype` (None: as they are). With FSDP
    every rank must call this (one tensor gathered at a time); rank 0 gets the tensors, the others
    an empty dict. Tied tensors (lm_head = embed_tokens) are returned once, under the first name.
    A float32 CPU parameter comes back as itself, not a copy (it is written out before the next
    update changes it); `into`: see `host_copies`."""
    sharded, inner = is_sharded(model), getattr(model, "module", model)
    # shards can be empty (data_ptr 0), so a tie is found by the parameter's identity there;
    # every rank skips the same names, so the gathers stay in step
    later = {name for names in tied_parameters(inner) for name in names[1:]} if sharded else set()
    seen: set[int] = set()
    entries = []
    for name, t in inner.state_dict().items():
        if name in later:
            continue
        if not sharded:
            if t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
        entries.append((name, t))
    return host_copies(entries, dtype, into, sharded)


def host_copies(
    entries: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    into: Destination | None,
    sharded: bool = False,
) -> dict[str, torch.Tensor]:
    """`entries` on the host, each cast to `dtype` on its device first (half the bytes to move
    with bfloat16). `into(layout)`: the host tensors to copy into (the publishing process's
    shared memory), so each tensor crosses from the device once, straight into them; into pinned
    memory the copies are asynchronous and wait only once, at the end, so with FSDP the other
    ranks never wait for rank 0's copies, only for each tensor's gather."""
    main = not sharded or torch_dist.get_rank() == 0
    layout = [(n, tuple(t.shape), dtype or t.dtype) for n, t in entries]
    dest = into(layout) if into is not None and main else None
    out: dict[str, torch.Tensor] = {}
    on_device = False
    for name, t in entries:
        t = t.detach()
        if sharded or t.device.type != "cpu" or dest is None:
            t = t.to(dtype or t.dtype)  # on the device: fewer bytes to gather and to move
        if sharded and hasattr(t, "full_tensor"):
            t = t.full_tensor()  # collective: every rank gathers this tensor
        if not main:
            continue
        if dest is None:
            out[name] = t.to("cpu").contiguous()
            continue
        on_device |= t.device.type == "cuda"
        out[name] = dest[name]
        out[name].copy_(t, non_blocking=t.device.type == "cuda" and out[name].is_pinned())
    if on_device:
        torch.cuda.synchronize()  # the asynchronous copies into pinned memory are done
    return out
