"""The learner's ranks: who this process is and how the ranks agree.

`rollctl start-learner --nproc N` runs N copies of the learner under torchrun, which sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; one process without them is rank 0 of 1 and never touches
torch.distributed. The backend is gloo on CPU and NCCL when the learner trains on CUDA.

Rank 0 is the only rank that issues prompts, publishes weights and writes the checkpoint's model
files; every rank reads trajectories as its own consumer `rank{r}` of the learner group and
acknowledges only its own entries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

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
        torch_dist.all_gather_object(out, obj)
        return out

    def sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch_dist.all_reduce(t)
        return float(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            torch_dist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and torch_dist.is_initialized():
            torch_dist.barrier()  # a rank that tears down early can leave the others hanging
            torch_dist.destroy_process_group()


def init_dist(device: str = "cpu") -> Dist:
    """Join the process group torchrun describes in the environment, if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    from rollflash.broker.redis_server import die_with_parent

    die_with_parent()  # a rank must not outlive torchrun's agent (kill -9 of the learner)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank=torch_dist.get_rank(), world_size=torch_dist.get_world_size())


def split_quotas(counts: list[int], total: int) -> list[int]:
    """How many of its ready groups each rank trains so that the ranks together train `total`:
    as even as the counts allow, rank order breaking ties, never more than a rank holds.

    counts [5, 0] total 4 -> [4, 0];  counts [3, 3] total 4 -> [2, 2];  [1, 9] total 4 -> [1, 3]
    """
    quotas = [0] * len(counts)
    left = min(total, sum(counts))
    while left > 0:
        for r in sorted(range(len(counts)), key=lambda r: (quotas[r], r)):
            if quotas[r] < counts[r]:
                quotas[r] += 1
                left -= 1
                break
    return quotas


def wrap_model(policy: torch.nn.Module, dist: Dist, strategy: str) -> torch.nn.Module:
    """The module the ranks train: the policy itself on one rank; DistributedDataParallel
    (`ddp`: a full replica per rank, gradients all-reduced); or FSDP2 (`fsdp`: `fully_shard` on
    every transformer block, then on the whole model, so parameters, gradients and optimiser
    state are sharded over the ranks). FSDP2 shards in place and returns the same object."""
    if dist.world_size == 1:
        return policy
    if strategy == "ddp":
        return DistributedDataParallel(policy)
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(policy, "_no_split_modules", None) or [])
    for module in policy.modules():
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(policy)
    return policy


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU: gathered from the shards with FSDP (every rank must call
    this; rank 0 gets the tensors, the others an empty dict), else the module's own."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return getattr(model, "module", model).state_dict()


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's state for a checkpoint (gathered to rank 0 with FSDP; collective)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return optimizer.state_dict()


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )
    else:
        optimizer.load_state_dict(state)
