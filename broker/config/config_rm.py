"""The `rm:` section of the run config, read by `rollctl train-rm` only (learner/tools/rm_training.py)."""

from __future__ import annotations

from pydantic import Field, StrictInt, StrictStr, model_validator

from rollflash.broker.config.config_base import Number, Section
from rollflash.broker.config.config_errors import ConfigError


class RewardModelTrainConfig(Section):
    """The `rm:` section, read by `rollctl train-rm` only: Bradley-Terry reward-model training
    (names as OpenRLHF's train_rm)."""

    pretrain: StrictStr | None = Field(
        None, description="initial weights, a local HF dir (null = model.path)"
    )
    dataset: StrictStr = Field(
        "data/preferences.jsonl", description='JSONL of {"prompt", "chosen", "rejected"}'
    )
    eval_dataset: StrictStr | None = Field(
        None, description="held-out pairs (null = the last eval_split of dataset)"
    )
    eval_split: Number = Field(
        0.1, gt=0, lt=1, description="share of dataset held out when eval_dataset is null"
    )
    save_path: StrictStr = Field(
        "models/rm", description="where the trained model is saved (a standard HF directory)"
    )
    max_epochs: StrictInt = Field(1, gt=0, description="passes over the training pairs")
    max_steps: StrictInt = Field(
        0, ge=0, description="stop after this many optimiser steps (0 = max_epochs decides)"
    )
    learning_rate: Number = Field(
        1e-4, gt=0, description="AdamW peak lr (linear warm-up, cosine decay to 10%)"
    )
    weight_decay: Number = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: Number = Field(1.0, ge=0, description="gradient clipping (0 = off)")
    train_batch_size: StrictInt = Field(
        32, gt=0, description="preference pairs per optimiser step, over all ranks"
    )
    micro_train_batch_size: StrictInt = Field(
        32, gt=0, description="pairs per forward/backward on one rank"
    )
    max_len: StrictInt = Field(
        512, gt=0, description="tokens of prompt + response + EOS, cut from the left"
    )
    eval_every: StrictInt = Field(
        0, ge=0, description="held-out accuracy every N steps (0 = only before and after)"
    )

    @model_validator(mode="after")
    def _train_batch_is_whole_micro_batches(self) -> RewardModelTrainConfig:
        if self.train_batch_size % self.micro_train_batch_size:
            raise ConfigError(
                f"rm.train_batch_size: must be a multiple of rm.micro_train_batch_size "
                f"({self.micro_train_batch_size}), got {self.train_batch_size}"
            )
        return self
