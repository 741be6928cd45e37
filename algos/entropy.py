"""Token entropy of the policy and the entropy bonus (`entropy_coef`).

H(pi(.|s_t)) = logsumexp(z) - sum_v softmax(z)_v z_v for logits z. An entropy bonus (Williams & Peng
1991; the c2 * S term of PPO, Schulman et al. 2017 eq. 9) is subtracted from the loss:
total = policy_loss + entropy_coef * entropy_bonus(...).loss, where that loss is -mean entropy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollflash.algos.aggregation import aggregate
from rollflash.algos.types import LossOutput


def entropy_from_logits(logits: Tensor) -> Tensor:
    """logits: [B, T, V] any float -> [B, T] float32 entropy in nats (float64 kept as float64; lower
    precisions are upcast, since bf16 softmax sums lose several digits).

    Logits of -inf (banned vocabulary entries) are allowed: their probability is 0 and they contribute 0,
    not 0 * -inf = NaN. Memory is O(B*T*V) float32; chunk over T in the caller for very large vocabularies.
    """
    z = logits if logits.dtype == torch.float64 else logits.float()
    log_z = torch.logsumexp(z, dim=-1)  # [B, T]
    p = torch.softmax(z, dim=-1)  # [B, T, V]
    finite_z = torch.where(torch.isfinite(z), z, torch.zeros((), dtype=z.dtype, device=z.device))
    return log_z - (p * finite_z).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor, mask: Tensor, *, agg_mode: str = "token-mean", norm_len: float | None = None
) -> LossOutput:
    """entropy [B, T] float32 (grad), mask [B, T] bool -> LossOutput(loss = -aggregate(entropy)),
    metric "policy/entropy" (the aggregated entropy, >= 0)."""
    mean_entropy = aggregate(entropy, mask, agg_mode, norm_len=norm_len)
    return LossOutput(loss=-mean_entropy, metrics={"policy/entropy": mean_entropy.detach()})
