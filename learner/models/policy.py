"""Building the policy the learner's ranks train (learner/build.py `build_models` calls it).

It needs torch, transformers (and peft for LoRA) and no broker client, so the GPU check
(scripts/gpu_smoke.py) builds its models through it on a machine without Redis.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollflash.broker.config.config import Config
from rollflash.broker.config.generation import neutral_generation_config
from rollflash.broker.config.model_dir import model_directory
from rollflash.learner.process.dist import Dist, wrap_model
from rollflash.learner.models.dropout import disable_dropout
from rollflash.learner.models.load import check_tied, place
from rollflash.learner.models.lora import peft_model, with_adapters
from rollflash.learner.models.memory import use_checkpointing

log = logging.getLogger(__name__)


def load_policy(cfg: Config, dist: Dist = Dist()) -> tuple[torch.nn.Module, Any]:
    """(the module the ranks train, tokenizer): float32 master weights on `dist.device`, read by
    rank 0 and broadcast (learner/models/load.py), dropout off (learner/models/dropout.py), with gradient
    checkpointing (learner/models/memory.py) and torch.compile as configured, wrapped for the ranks
    (DDP, or FSDP2 shards)."""
    path, remote = model_directory(cfg.model.path), cfg.model.trust_remote_code  # dir or hub id
    trainer, kwargs = (
        cfg.trainer,
        {
            "dtype": torch.float32,
            "attn_implementation": cfg.model.attn_implementation,
            "trust_remote_code": remote,
        },
    )

    def wrap(policy: torch.nn.Module) -> torch.nn.Module:
        if trainer.disable_dropout:  # the ratio moves with the weights only (learner/models/dropout.py)
            disable_dropout(policy)
        hf = cast(PreTrainedModel, policy)  # a HF model, or peft's wrapper that forwards to one
        lora = peft_model(policy)
        base = hf if lora is None else lora.get_base_model()
        if use_checkpointing(cfg, policy, base.config, dist.world_size, dist.device):
            hf.gradient_checkpointing_enable({"use_reentrant": False})
        if trainer.compile:
            blocks = set(hf._no_split_modules or [])
            for m in policy.modules():
                if type(m).__name__ in blocks:
                    m.compile()
        return wrap_model(policy, dist, trainer.strategy, cfg.model.dtype)

    lora = cfg.model.lora  # the base wrapped by peft (learner/models/lora.py) before it is placed

    def adapted(base: torch.nn.Module) -> torch.nn.Module:
        return base if lora is None else with_adapters(base, lora)

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)

    def loaded() -> torch.nn.Module:
        """The checkpoint, generating (held-out evaluation) with the run's settings only."""
        hf: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        uses = "held-out evaluation generates greedily or at eval.temperature"
        neutral_generation_config(hf, eos, pad, f"learner: {path}", uses, log)
        return adapted(hf)

    model = place(
        loaded,
        lambda: adapted(
            AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=remote), **kwargs
            )
        ),
        dist,
        wrap,
        sharded=trainer.strategy == "fsdp" and dist.world_size > 1,
    )
    check_tied(model)
    return model, tokenizer
