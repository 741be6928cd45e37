"""Building the policy the learner's ranks train (learner/build.py `build_models` calls it).

It needs torch, transformers (and peft for LoRA) and no broker client, so the GPU check
(scripts/gpu_smoke.py) builds its models through it on a machine without Redis.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollflash.broker.config import Config
from rollflash.broker.model_dir import model_directory
from rollflash.learner.dist import Dist, wrap_model
from rollflash.learner.load import check_tied, place
from rollflash.learner.lora import peft_model, with_adapters
from rollflash.learner.memory import use_checkpointing


def load_policy(cfg: Config, dist: Dist = Dist()) -> tuple[torch.nn.Module, Any]:
    """(the module the ranks train, tokenizer): float32 master weights on `dist.device`, read by
    rank 0 and broadcast (learner/load.py), with gradient checkpointing (learner/memory.py) and
    torch.compile as configured, wrapped for the ranks (DDP, or FSDP2 shards)."""
    path, remote = model_directory(cfg.model.path), cfg.model.trust_remote_code  # dir or hub id
    t, kwargs = (
        cfg.trainer,
        {
            "dtype": torch.float32,
            "attn_implementation": cfg.model.attn_implementation,
            "trust_remote_code": remote,
        },
    )

    def wrap(policy: torch.nn.Module) -> torch.nn.Module:
        hf = cast(PreTrainedModel, policy)  # a HF model, or peft's wrapper that forwards to one
        lora = peft_model(policy)
        base = hf if lora is None else lora.get_base_model()
        if use_checkpointing(cfg, policy, base.config, dist.world_size, dist.device):
            hf.gradient_checkpointing_enable({"use_reentrant": False})
        if t.compile:
            blocks = set(hf._no_split_modules or [])
            for m in policy.modules():
                if type(m).__name__ in blocks:
                    m.compile()
        return wrap_model(policy, dist, t.strategy, cfg.model.dtype)

    lora = cfg.model.lora  # the base wrapped by peft (learner/lora.py) before it is placed

    def adapted(base: torch.nn.Module) -> torch.nn.Module:
        return base if lora is None else with_adapters(base, lora)

    model = place(
        lambda: adapted(AutoModelForCausalLM.from_pretrained(path, **kwargs)),
        lambda: adapted(
            AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=remote), **kwargs
            )
        ),
        dist,
        wrap,
        sharded=t.strategy == "fsdp" and dist.world_size > 1,
    )
    check_tied(model)
    return model, AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
