"""Bradley-Terry preference loss for reward-model training (`rollctl train-rm`).

A reward model r(x, y) is fitted to pairs (x, y_chosen, y_rejected) by maximising the likelihood of
the Bradley-Terry model P(chosen > rejected) = sigmoid(r_chosen - r_rejected) (Bradley & Terry 1952;
the reward-model loss of Ouyang et al. 2022, InstructGPT eq. 1, and of Stiennon et al. 2020):

    loss = -mean_i log sigmoid(r_chosen_i - r_rejected_i)

No margin term and no K-choose-2 weighting (InstructGPT batches all pairs of one prompt together;
our pairs are independent rows). Pairwise accuracy counts ties as wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rollflash.algos.types import LossOutput


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> LossOutput:
    """chosen [P] float32, rejected [P] float32: scalar rewards of the two responses of P pairs.

    -> LossOutput(loss = -mean log sigmoid(chosen - rejected), metrics "rm/acc" (share of pairs with
    chosen > rejected), "rm/margin" (mean chosen - rejected), "rm/chosen_mean", "rm/rejected_mean").
    An empty batch gives loss 0 (differentiable) and zero metrics.
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected must both be [P], got {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}"
        )
    if chosen.numel() == 0:
        zero = torch.zeros(())
        return LossOutput(
            loss=(chosen.sum() + rejected.sum()) * 0.0,
            metrics={
                "rm/acc": zero,
                "rm/margin": zero,
                "rm/chosen_mean": zero,
                "rm/rejected_mean": zero,
            },
        )
    margin = chosen.float() - rejected.float()
    loss = -F.logsigmoid(margin).mean()
    d = margin.detach()
    return LossOutput(
        loss=loss,
        metrics={
            "rm/acc": (d > 0).float().mean(),
            "rm/margin": d.mean(),
            "rm/chosen_mean": chosen.detach().float().mean(),
            "rm/rejected_mean": rejected.detach().float().mean(),
        },
    )
