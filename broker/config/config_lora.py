"""`model.lora:` train low-rank adapters (LoRA, Hu et al. 2021) with `peft` instead of every
weight; null (the default) trains the full model.

Names follow peft's `LoraConfig` (`r` is `rank`, `lora_alpha` is `alpha`): the adapter adds
(alpha / rank) * B A to each targeted linear layer, A [rank, in] drawn at random, B [out, rank]
zero, so the step-0 policy is the base model. `modules_to_save` are trained in full beside the
adapters (e.g. `lm_head`). See docs/lora.md for what is published and how generators load it.
"""

from __future__ import annotations

from pydantic import Field, StrictInt, StrictStr

from rollflash.broker.config.config_base import Number, Section


class LoRAConfig(Section):
    """`model.lora:` the adapters' shape (peft's LoraConfig)."""

    rank: StrictInt = Field(16, gt=0, le=512, description="rank r of each adapter (peft's r)")
    alpha: Number = Field(
        32.0, gt=0, description="scaling: the update is (alpha / rank) * B A (peft's lora_alpha)"
    )
    dropout: Number = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapters' input while training; "
        "only with trainer.disable_dropout: false",
    )
    target_modules: list[StrictStr] | StrictStr = Field(
        "all-linear",
        description="module names (or suffixes) that get adapters; 'all-linear': every linear "
        "layer but the output head",
    )
    modules_to_save: list[StrictStr] = Field(
        default_factory=list,
        description="modules trained in full beside the adapters and published with them",
    )
