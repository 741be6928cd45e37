"""A step's batch and its micro-batches, and how they are built from the step's groups.

Every sequence is prompt + response, right-padded. Tensors are aligned with next-token targets:
position t of a [b, L-1] tensor describes the token at t+1, predicted from tokens 0..t. The mask
is True exactly on the response tokens that count, so prompt and padding positions (and samples
masked by `algo.overlong_filter`) contribute nothing.

Multi-turn episodes (envs/episode.py) carry a `loss_mask` over their response: observation tokens
the environment wrote are not the policy's, so their targets are masked out too, and
`turn_inputs` lays out the per-turn rewards and state keys the step-level estimators need.

    seqs  = pad_groups(groups)           # Sequences, on the host, group-major (row g * n + j is
                                         # sample j of group g): the estimators need the groups
    seqs  = seqs.to(device)              # the step's one copy to the learner's device
    step  = StepBatch.of(seqs, advantages=..., ref_logp=..., ...)   # learner/step/prepare.py
    micro = step.micro_batch(rows)       # length-sorted rows, trimmed to their longest sequence

A `StepBatch` is built once, from return values, and is frozen: nothing fills a field of it
later. Its micro-batches are slices of it on the same device. A further per-token input of the
model's forward pass (routing data, say) rides along in `model_inputs` ([b, L, ...], sliced and
trimmed with the tokens, passed to the forward by learner/step/logprobs.py), and the losses never see
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from rollflash.algos import TurnInputs
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.process.device import batch_to_device
from rollflash.learner.step.packing import budget_chunks

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config

TOKENS = MappingProxyType({"columns": "tokens"})  # a field laid out like input_ids: [b, L, ...]
ROWS = MappingProxyType({"columns": "rows"})  # a field of one value per row: [b]
NO_INPUTS: Mapping[str, torch.Tensor] = MappingProxyType({})


@dataclass(frozen=True)
class Sequences:
    """Right-padded sequences and their targets: what a forward pass reads. A field's columns
    are the targets' ([b, L-1]) unless its metadata says TOKENS ([b, L])."""

    input_ids: torch.Tensor = field(metadata=TOKENS)  # [b, L] int64, right-padded with 0
    attention_mask: torch.Tensor = field(metadata=TOKENS)  # [b, L] int64
    mask: torch.Tensor  # [b, L-1] bool, True on response-token targets that count
    behav_logp: torch.Tensor  # [b, L-1] float32, 0 where mask is False
    # further keyword inputs of the model's forward pass, each [b, L, ...] per token
    model_inputs: Mapping[str, torch.Tensor] = field(
        default_factory=lambda: NO_INPUTS, metadata=TOKENS
    )
    # [b] int64, each row's generator: an index into `generators`, -1 for a row sampled with
    # older weights than the learner's (learner/metrics/mismatch.py)
    generator: torch.Tensor | None = field(default=None, kw_only=True, metadata=ROWS)
    generators: tuple[str, ...] = field(default=(), kw_only=True)  # the step's, sorted

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

    def to(self, device: torch.device) -> Sequences:
        """The same rows with every tensor on `device` (itself where it is there already)."""
        return batch_to_device(self, device)


@dataclass(frozen=True)
class PreparedRows(Sequences):
    """Sequences with what learner/step/prepare.py computed for their targets, [b, L-1] float32 each."""

    advantages: torch.Tensor = field(kw_only=True)  # 0 where mask is False
    returns: torch.Tensor | None = None  # critic targets (with a critic)
    ref_logp: torch.Tensor | None = None  # frozen reference (when kl_coef > 0)
    old_values: torch.Tensor | None = None  # critic values before the update (with a critic)
    prox_logp: torch.Tensor | None = None  # policy before the step's updates (M x E > 1)


@dataclass(frozen=True)
class StepBatch(PreparedRows):
    """The whole step, group-major, on the learner's device: built once by `prepare_batch` from
    return values and never changed (frozen)."""

    @classmethod
    def of(cls, seqs: Sequences, **prepared: Any) -> StepBatch:
        """`seqs` with what was prepared for them: the fields `PreparedRows` adds, by name."""
        return cls(**{f.name: getattr(seqs, f.name) for f in dataclasses.fields(seqs)}, **prepared)

    def micro_batch(self, rows: torch.Tensor, width: int | None = None) -> MicroBatch:
        """The micro-batch of the given rows ([k] int64), trimmed as `take` trims them."""
        return MicroBatch(**_sliced(self, rows, width))


@dataclass(frozen=True)
class MicroBatch(PreparedRows):
    """Rows of a StepBatch, trimmed to their longest sequence: what one pass of a loss reads."""


Batch = TypeVar("Batch", bound=Sequences)


def take(batch: Batch, rows: torch.Tensor, width: int | None = None) -> Batch:
    """The given rows of `batch` ([k] int64 indices), trimmed to their longest sequence (`width`
    tokens when the caller knows it from the host, which saves a read from the device)."""
    return type(batch)(**_sliced(batch, rows, width))


def _sliced(batch: Sequences, rows: torch.Tensor, width: int | None) -> dict[str, Any]:
    """Every field of `batch` at `rows`, its columns cut to `width` (tokens) or `width` - 1."""
    if width is None:
        width = int(batch.lengths[rows].max())
    parts: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        layout = f.metadata.get("columns")
        cols = width if layout == "tokens" else width - 1
        if isinstance(value, torch.Tensor):
            parts[f.name] = value[rows] if layout == "rows" else value[rows, :cols]
        elif isinstance(value, Mapping):  # model_inputs
            parts[f.name] = MappingProxyType({k: v[rows, :cols] for k, v in value.items()})
        elif value is not None:  # the step's generators
            parts[f.name] = value
    return parts


def pad_groups(
    groups: list[Trajectory], keep: torch.Tensor | None = None, version: int | None = None
) -> Sequences:
    """All samples of `groups`, group-major, padded to the longest, on the host.

    keep: [B] bool or None; a sample with keep False has an all-False mask row (it stays in the
    batch, so its group keeps its shape and its score still enters the group baseline).
    version: the learner's version at the step's start; a row's `generator` index is -1 unless
    its group was sampled entirely with it (learner/metrics/mismatch.py compares an engine with
    the learner on the same weights only). None: every row's generator.

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
    generator, generators = _generator_rows(groups, version)
    return Sequences(
        torch.from_numpy(input_ids),
        torch.from_numpy(attention),
        torch.from_numpy(mask),
        torch.from_numpy(behav),
        generator=generator,
        generators=generators,
    )


def _generator_rows(
    groups: list[Trajectory], version: int | None
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """([B] int64, the step's generators sorted): each row's index into them, -1 for a row of a
    group sampled with older weights than `version` (`pad_groups`)."""
    generators = tuple(sorted({g.generator for g in groups}))
    index = {name: i for i, name in enumerate(generators)}
    rows = [
        index[g.generator] if version is None or g.behavior_version >= version else -1
        for g in groups
        for _ in g.samples
    ]
    return torch.tensor(rows, dtype=torch.int64), generators


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


def put(full: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """Write a micro-batch's [k, w] tensor back into the rows of a [B, L-1] one (w <= L-1)."""
    full[rows, : part.shape[1]] = part


def dummy_input(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [1, 2] int64: the input of a rank's zero-weighted pass."""
    return (
        torch.zeros(1, 2, dtype=torch.long, device=device),
        torch.ones(1, 2, dtype=torch.long, device=device),
    )


@dataclass(frozen=True)
class BatchSpec:
    """How a step's rows are dealt into mini-batches and micro-batches (`BatchSpec.of`)."""

    group_size: int  # rollout.num_return_sequences: rows per group
    micro_batch_size: int  # trainer.micro_batch_size: rows per micro-batch
    token_budget: int  # trainer.token_budget: tokens per micro-batch, packed (0: rows)
    mini_batches: int  # trainer.ppo_mini_batches: optimiser updates per epoch

    @classmethod
    def of(cls, cfg: Config) -> BatchSpec:
        t = cfg.trainer
        return cls(
            cfg.rollout.num_return_sequences, t.micro_batch_size, t.token_budget, t.ppo_mini_batches
        )


def mini_batch_rows(
    num_groups: int, group_size: int, mini_batches: int, first_group: int = 0
) -> list[torch.Tensor]:
    """Rows of a group-major batch ([num_groups * group_size] rows) in each mini-batch: group j
    of this rank is group first_group + j of the step, and group i goes to mini-batch i mod M.

    4 groups of 2 samples, M = 2, first_group 1: groups 0, 2 -> mini-batch 1 (rows 0 1 4 5),
    groups 1, 3 -> mini-batch 0 (rows 2 3 6 7)."""
    rows = torch.arange(num_groups * group_size).reshape(num_groups, group_size)
    of_group = (torch.arange(num_groups) + first_group) % mini_batches
    return [rows[of_group == m].reshape(-1) for m in range(mini_batches)]


def chunk_rows(seqs: Sequences, rows: torch.Tensor, spec: BatchSpec) -> list[torch.Tensor]:
    """The micro-batches of the given rows of `seqs`: at most `micro_batch_size` sequences
    sorted by length, or with a `token_budget` at most that many tokens (learner/step/packing.py)."""
    if spec.token_budget:
        return [rows[c] for c in budget_chunks(seqs.lengths[rows], spec.token_budget)]
    if len(rows) == seqs.input_ids.shape[0]:  # the whole batch: no indirection
        return length_sorted_chunks(seqs, spec.micro_batch_size)
    order = rows[torch.argsort(seqs.lengths[rows], stable=True)]
    size = spec.micro_batch_size
    return [order[i : i + size] for i in range(0, len(order), size)]


def length_sorted_chunks(batch: Sequences, size: int) -> list[torch.Tensor]:
    """Row indices of the micro-batches: at most `size` rows each, sorted by length."""
    order = torch.argsort(batch.lengths, stable=True)
    return [order[i : i + size] for i in range(0, len(order), size)]
