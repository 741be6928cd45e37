"""Step-level advantages for multi-turn episodes: discounted per-turn returns and GiGPO's grouping
of identical states.

Trajectory-level GRPO needs nothing new: the episode's total reward is the sample's score, and the
loss mask keeps observation tokens out, so every action token of an episode gets the same
group-relative advantage (`adv_estimator: grpo`, the default).

GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", Sec. 3):
episodes of one group start from the same state, so they often pass through identical states
("anchor states"). For turn k of episode i, acting in state s:

    R_k^i   = sum_{j >= k} gamma^(j-k) r_j^i                  discounted return from turn k (eq. 5)
    A^S_k,i = (R_k^i - mean G(s)) / (std G(s) + eps)          G(s): the returns of every turn of the
                                                              group's episodes taken in state s (eq. 6)
    A       = A^E_i + omega * A^S_k,i                         A^E: episode-level GRPO (eq. 7)

with gamma per turn (the paper uses 0.95) and omega = 1 as in the paper. As in `grpo_advantages`,
std is the unbiased (n - 1) sample std, and a step group of one turn gets A^S = 0 (no baseline).
States are compared by a key (envs/episode.py hashes the observation text); the paper compares
the environment states themselves, which is the same for text environments that render the full
state.

Turn tensors are [B, K]: K is the most turns of any episode in the batch, `mask` marks real turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollflash.algos.masked import masked_fill_zero


@dataclass
class TurnInputs:
    token_turn: Tensor  # [B, T] int64, turn index of each action token, -1 on other positions
    rewards: Tensor  # [B, K] float32, per-turn rewards (0 on padding turns)
    mask: Tensor  # [B, K] bool, turns that exist
    state_ids: Tensor  # [B, K] int64, key of the state each turn acted in


def turn_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """R_k = r_k + gamma * R_{k+1} over real turns.

    rewards: [B, K] float; mask: [B, K] bool -> [B, K] float, 0 on padding turns.
    """
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)  # [B]
    rewards = masked_fill_zero(rewards, mask)
    for k in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, k], rewards[:, k] + gamma * running, running)
        out[:, k] = torch.where(mask[:, k], running, torch.zeros_like(running))
    return out


def step_group_advantages(
    returns: Tensor, state_ids: Tensor, mask: Tensor, group_size: int, eps: float = 1e-6
) -> Tensor:
    """GiGPO's step-level advantage A^S (module docstring): each turn's return normalised within
    its step group, the turns of one episode group (rows g*n .. g*n+n-1) that share a state key.

    returns: [B, K] float; state_ids: [B, K] int64; mask: [B, K] bool; B = G * n -> [B, K] float,
    0 on padding turns and on turns alone in their step group.
    """
    B, K = returns.shape
    if group_size < 1 or B % group_size:
        raise ValueError(f"{B} episodes do not split into groups of {group_size}")
    group = (torch.arange(B, device=returns.device) // group_size).unsqueeze(-1).expand(B, K)
    keys = torch.stack([group[mask], state_ids[mask]], dim=-1)  # [M, 2]
    _, step_group = torch.unique(keys, dim=0, return_inverse=True)  # [M]
    values = returns[mask].to(torch.float64)  # [M]
    n_groups = int(step_group.max()) + 1 if values.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=values.device).index_add_(
        0, step_group, torch.ones_like(values)
    )
    total = torch.zeros(n_groups, dtype=torch.float64, device=values.device).index_add_(
        0, step_group, values
    )
    mean = total / count
    centred = values - mean[step_group]
    sq = torch.zeros(n_groups, dtype=torch.float64, device=values.device).index_add_(
        0, step_group, centred**2
    )
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    adv = torch.where(
        count[step_group] > 1, centred / (std[step_group] + eps), torch.zeros_like(centred)
    )
    out = torch.zeros_like(returns)
    out[mask] = adv.to(returns.dtype)
    return out


def turns_to_tokens(per_turn: Tensor, token_turn: Tensor, mask: Tensor) -> Tensor:
    """Spread per-turn values over the turns' action tokens.

    per_turn: [B, K] float; token_turn: [B, T] int64 (-1: no turn); mask: [B, T] bool
    -> [B, T] float, 0 where token_turn is -1 or mask is False.
    """
    picked = per_turn.gather(1, token_turn.clamp(min=0))  # [B, T]
    return masked_fill_zero(picked, mask & (token_turn >= 0))
