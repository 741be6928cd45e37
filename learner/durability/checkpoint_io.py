"""The tensors of a checkpoint: model and optimiser state through `torch.distributed.checkpoint`.

`Trainables` is what a checkpoint holds besides `state.json`: the policy and its optimiser, and the
critic and its optimiser. Its state dict is the one `torch.distributed.checkpoint.state_dict`
builds (`get_state_dict`): names without wrapper prefixes, FSDP shards as DTensors, optimiser state
keyed by parameter name. DCP writes each rank's shard to its own file and records the global
layout, so a checkpoint written by 2 FSDP ranks loads on 1 rank (a plain module) or 4, and the
reverse: each rank reads only the pieces its shards need.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from rollflash.learner.models.lora import peft_model

DCP_DIR = "dcp"


@dataclass
class Trainables:
    """The modules and optimisers a checkpoint saves (a DCP `Stateful`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def of(cls, models: Any, optim: Any) -> Trainables:
        """From the learner's `Models` and `Optim` (learner/rank.py)."""
        algo = models.algo
        return cls(models.model, optim.optimizer, algo.critic, algo.critic_optimizer)

    def _pairs(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        pairs = {"policy": (self.model, self.optimizer)}
        if self.critic is not None:
            pairs["critic"] = (self.critic, self.critic_optimizer)
        return pairs

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (module, optim) in self._pairs().items():
            model_sd, optim_sd = get_state_dict(module, optim or [], options=_options(module))
            if peft_model(module) is not None:
                model_sd = {k: v for k, v in model_sd.items() if k in _trainable(module)}
            out[name] = {"model": model_sd, **({"optim": optim_sd} if optim else {})}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, (module, optim) in self._pairs().items():
            part = state[name]
            set_state_dict(
                module,
                optim or [],
                model_state_dict=part["model"],
                optim_state_dict=part.get("optim", {}),
                options=_options(module),
            )


def _trainable(module: torch.nn.Module) -> set[str]:
    """The names of a LoRA policy's trainable tensors; a frozen tensor tied to another name
    (lm_head = embed_tokens) is left out under both."""
    inner = peft_model(module)
    return {n for n, p in inner.named_parameters(remove_duplicate=False) if p.requires_grad}


def _options(module: torch.nn.Module) -> StateDictOptions:
    """A LoRA policy (learner/models/lora.py) saves and loads only its trainable tensors: its frozen
    base is `model.path`, loaded again at resume, so it is neither written nor expected."""
    lora = peft_model(module) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


@contextmanager
def _single_process_quiet(single: bool) -> Iterator[None]:
    """DCP warns on every save and load of a single process ("torch.distributed is disabled,
    unavailable or uninitialized, assuming the intent is to save in a single process") even when
    asked for exactly that (`no_dist=True`); only that warning is silenced, only then."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
        yield


def save_dcp(trainables: Trainables, directory: Path) -> None:
    """Collective: every rank writes its shard under `directory` (fsynced by DCP's writer)."""
    single = not _distributed()
    with _single_process_quiet(single):
        dcp.save({"app": trainables}, checkpoint_id=str(directory), no_dist=single)


def load_dcp(trainables: Trainables, directory: Path) -> None:
    """Collective: every rank reads the pieces of its shards and loads them in place."""
    single = not _distributed()
    with _single_process_quiet(single):
        dcp.load({"app": trainables}, checkpoint_id=str(directory), no_dist=single)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
