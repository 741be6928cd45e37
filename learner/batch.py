"""Turning accepted groups into padded training tensors, and splitting them into micro-batches.

Every sequence is prompt + response, right-padded. Tensors are aligned with next-token targets:
position t of a [b, L-1] tensor describes the token at t+1, predicted from tokens 0..t. The mask
is True exactly on the response tokens that count, so prompt and padding positions (and samples
masked by `algo.overlong_filter`) contribute nothing.

Multi-turn episodes (envs/episode.py) carry a `loss_mask` over their response: observation tokens
the environment wrote are not the policy's, so their targets are masked out too, and
`turn_inputs` lays out the per-turn rewards and state keys the step-level estimators need.

The whole step's batch is first padded in group-major order (row g * n + j is sample j of group g),
because the advantage estimators need the groups; micro-batches are length-sorted slices of it,
trimmed to their own longest sequence to limit padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from rollflash.algos import TurnInputs
from rollflash.broker.schema import Sample, Trajectory


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [b, L] int64
    mask: torch.Tensor  # [b, L-1] bool, True on response-token targets that count
    behav_logp: torch.Tensor  # [b, L-1] float32, 0 where mask is False
    advantages: torch.Tensor  # [b, L-1] float32, 0 where mask is False
    ref_logp: torch.Tensor | None = None  # [b, L-1] float32, frozen reference (when kl_coef > 0)
    old_values: torch.Tensor | None = None  # [b, L-1] float32, critic values before the update
    returns: torch.Tensor | None = None  # [b, L-1] float32, critic targets (with a critic)
    prox_logp: torch.Tensor | None = None  # [b, L-1] float32, policy before the step's updates

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_seqs(self) -> int:
        """Rows with at least one selected token: the denominator of the seq-mean-* modes."""
        return int(self.mask.any(dim=-1).sum())

    @property
    def lengths(self) -> torch.Tensor:
        """[b] int64, tokens per sequence (prompt + response)."""
        return self.attention_mask.sum(dim=-1)


def pad_groups(groups: list[Trajectory], keep: torch.Tensor | None = None) -> MicroBatch:
    """All samples of `groups`, group-major, padded to the longest; advantages still zero.

    keep: [B] bool or None; a sample with keep False has an all-False mask row (it stays in the
    batch, so its group keeps its shape and its score still enters the group baseline).

    Built with a few array operations over the whole batch, not per sample: every sample's
    tokens (prompt, then response) are concatenated once and scattered to (row, column) pairs.
    """
    seqs = [(g.prompt_ids, s) for g in groups for s in g.samples]
    b = len(seqs)
    plen = np.fromiter((len(p) for p, _ in seqs), np.int64, b)
    rlen = np.fromiter((len(s.response_ids) for _, s in seqs), np.int64, b)
    lengths = plen + rlen
    width = int(lengths.max()) if b else 1  # [0, 1]: no groups
    input_ids = np.zeros((b, width), np.int64)
    if b:
        tokens = np.concatenate([a for p, s in seqs for a in (p, s.response_ids)])
        input_ids[_rows(lengths), _cols(lengths)] = tokens
    # targets of the response tokens: columns len(prompt) - 1 .. len(prompt) + len(response) - 2
    rrows, rcols = _rows(rlen), _cols(rlen) + np.repeat(plen - 1, rlen)
    mask = np.zeros((b, width - 1), bool)
    selected = np.ones(int(rlen.sum()), bool)
    if keep is not None:
        selected &= np.repeat(keep.numpy().astype(bool), rlen)
    if any(
        s.loss_mask is not None for _, s in seqs
    ):  # multi-turn: observations are not the policy's
        selected &= np.concatenate(
            [
                s.loss_mask.astype(bool)
                if s.loss_mask is not None
                else np.ones(len(s.response_ids), bool)
                for _, s in seqs
            ]
        )
    mask[rrows, rcols] = selected
    behav = np.zeros((b, width - 1), np.float32)
    if b:
        behav[rrows, rcols] = np.concatenate([s.logprobs for _, s in seqs])
    attention = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    behav_t = torch.from_numpy(behav)
    return MicroBatch(
        torch.from_numpy(input_ids),
        torch.from_numpy(attention),
        torch.from_numpy(mask),
        behav_t,
        torch.zeros_like(behav_t),
    )


def _rows(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] int64: row i repeated counts[i] times."""
    return np.repeat(np.arange(len(counts)), counts)


def _cols(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] int64: 0 .. counts[i] - 1 for each row i in turn."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) - np.repeat(starts, counts)


def turn_inputs(groups: list[Trajectory], mask: torch.Tensor) -> TurnInputs | None:
    """Per-turn tensors of a group-major batch (rows as in `pad_groups`), or None if no sample is a
    multi-turn episode. mask: [B, L-1] bool, the batch's mask (token_turn is -1 where it is False).

    token_turn[i, t] = k for the targets of turn k's action tokens: response position p maps to
    column len(prompt) - 1 + p, and p belongs to the last turn whose start is <= p.
    """
    samples = [(len(g.prompt_ids), s) for g in groups for s in g.samples]
    if all(s.turn_starts is None for _, s in samples):
        return None
    if any(s.turn_starts is None for _, s in samples):
        raise ValueError("a batch mixes multi-turn episodes with single-turn samples")
    turns = [_turns(s) for _, s in samples]
    B, K = len(samples), max(len(starts) for starts, _, _ in turns)
    rewards = torch.zeros(B, K, dtype=torch.float32)
    turn_mask = torch.zeros(B, K, dtype=torch.bool)
    states = torch.zeros(B, K, dtype=torch.int64)
    token_turn = torch.full(mask.shape, -1, dtype=torch.int64)
    for i, ((plen, s), (turn_starts, turn_rewards, turn_states)) in enumerate(zip(samples, turns)):
        k = len(turn_starts)
        rewards[i, :k] = torch.from_numpy(turn_rewards.astype("float32"))
        turn_mask[i, :k] = True
        states[i, :k] = torch.from_numpy(turn_states.astype("int64"))
        starts = torch.from_numpy(turn_starts.astype("int64"))
        positions = torch.arange(len(s.response_ids))
        turn_of = torch.searchsorted(starts, positions, right=True) - 1  # [T_i]
        token_turn[i, plen - 1 : plen - 1 + len(positions)] = turn_of
    token_turn[~mask] = -1
    return TurnInputs(token_turn=token_turn, rewards=rewards, mask=turn_mask, state_ids=states)


def _turns(s: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(turn_starts, turn_rewards, turn_states) of a multi-turn sample."""
    assert s.turn_starts is not None and s.turn_rewards is not None and s.turn_states is not None
    return s.turn_starts, s.turn_rewards, s.turn_states  # the wire checks all four or none


def take(batch: MicroBatch, rows: torch.Tensor) -> MicroBatch:
    """The given rows of `batch` ([k] int64 indices), trimmed to their longest sequence."""
    width = int(batch.lengths[rows].max())
    parts = {}
    for f in dataclasses.fields(batch):
        t = getattr(batch, f.name)
        if t is not None:
            cols = width if f.name in ("input_ids", "attention_mask") else width - 1
            parts[f.name] = t[rows, :cols]
    return MicroBatch(**parts)


def put(full: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """Write a micro-batch's [k, w] tensor back into the rows of a [B, L-1] one (w <= L-1)."""
    full[rows, : part.shape[1]] = part


def dummy_input(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [1, 2] int64: the input of a rank's zero-weighted pass."""
    return (
        torch.zeros(1, 2, dtype=torch.long, device=device),
        torch.ones(1, 2, dtype=torch.long, device=device),
    )


def length_sorted_chunks(batch: MicroBatch, size: int) -> list[torch.Tensor]:
    """Row indices of the micro-batches: at most `size` rows each, sorted by length."""
    order = torch.argsort(batch.lengths, stable=True)
    return [order[i : i + size] for i in range(0, len(order), size)]
