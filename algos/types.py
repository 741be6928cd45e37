"""Shared result type for every loss in `algos/`.

A loss function returns one differentiable scalar and a flat dict of detached scalar metrics whose names
are stable across runs and variants ("policy/clip_frac", "offpolicy/is_weight_max", ...), so that
dashboards and regression checks can key on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    """What a loss returns.

    loss: scalar, differentiable; the caller scales it (by a coefficient or for gradient accumulation)
        and calls backward.
    metrics: detached 0-dim tensors keyed by namespaced names; reading them never touches the graph.
    """

    loss: torch.Tensor  # [] differentiable
    metrics: dict[str, torch.Tensor]  # name -> [] detached
