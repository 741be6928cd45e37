"""`rollout.device`: where the hf engine and the reward-model scorer run (vllm places itself).

`auto` takes cuda:0 when torch sees a GPU (the first of the process's CUDA_VISIBLE_DEVICES, which
`rollctl run --gpus` or `rollctl start-generator --gpus` set), else the CPU; `cuda` insists on one.
"""

from __future__ import annotations

import os

import torch

from rollflash.broker.config.config_errors import ConfigError


def resolve_device(setting: str) -> torch.device:
    """auto | cpu | cuda -> the torch device; `cuda` without a visible GPU is a ConfigError."""
    if setting == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if setting == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            "rollout.device: cuda, but torch sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}, "
            f"torch {torch.__version__}); use auto or cpu"
        )
    return torch.device("cpu")


def resolve_dtype(setting: str, model_dtype: str) -> str:
    """A section's dtype key: auto follows `model.dtype`."""
    return model_dtype if setting == "auto" else setting
