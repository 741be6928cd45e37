"""Temporal credit assignment over response tokens: discounted returns and GAE.

Rewards live on tokens ([B, T]); the outcome score sits on the last response token (see
`place_terminal_reward`) and dense terms such as a per-token KL penalty anywhere.

Masks may have holes (multi-turn: environment/tool tokens between model turns are masked out). A masked
position is not a step: the backward recursion passes the running return / GAE and the next value through
it unchanged, so the last model token of turn k bootstraps from the first model token of turn k+1. A
reward placed on a masked position is ignored. With the usual right-padded contiguous mask this is exactly
the textbook recursion with V(terminal) = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollflash.algos.masked import masked_fill_zero


def place_terminal_reward(scores: Tensor, mask: Tensor) -> Tensor:
    """Put each response's scalar score on its last selected token.

    scores: [B] float, one outcome reward per response
    mask:   [B, T] bool
    -> [B, T] same dtype as scores; zeros elsewhere (a row with no selected token gets nothing)
    """
    B, T = mask.shape
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(
        dim=-1
    )  # [B] int64, -1 if empty
    at_last = positions == last.unsqueeze(-1)  # [B, T] bool
    return masked_fill_zero(scores.unsqueeze(-1).expand(B, T), at_last & mask)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over selected tokens (masked positions skipped).

    token_rewards: [B, T] float; mask: [B, T] bool -> [B, T] float, 0 at masked positions.
    """
    B, T = mask.shape
    running = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)  # [B]
    out = torch.zeros_like(token_rewards)
    rewards = masked_fill_zero(token_rewards, mask)
    for t in reversed(range(T)):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16):

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   R_t = A_t + V_t

    with V after the last selected token = 0 (the response ended). No advantage whitening here (PPO
    implementations often whiten; do it with `masked_whiten` if wanted).

    token_rewards: [B, T] float, rewards on tokens (outcome score on the last token)
    values:        [B, T] float, critic values V(s_t) (detached; values at masked positions are ignored)
    mask:          [B, T] bool
    -> (advantages [B, T], returns [B, T]), both 0 at masked positions
    """
    B, T = mask.shape
    rewards = masked_fill_zero(token_rewards, mask)
    values = masked_fill_zero(values.detach(), mask)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # [B]
    next_adv = torch.zeros_like(next_value)  # [B]
    adv = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        next_adv = torch.where(m, a_t, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, a_t, torch.zeros_like(a_t))
    returns = masked_fill_zero(adv + values, mask)
    return adv, returns
