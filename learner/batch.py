"""Turning accepted groups into padded training tensors.

Every sequence is prompt + response, right-padded. Tensors are aligned with next-token targets:
position t of a [b, L-1] tensor describes the token at t+1, predicted from tokens 0..t. The mask
is True exactly on response tokens, so prompt and padding positions contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos import grpo_advantages
from broker.schema import Trajectory


@dataclass
class SequenceRecord:
    tokens: list[int]  # prompt + response
    prompt_len: int
    behav_logp: list[float]  # one per response token
    advantage: float


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [b, L] int64
    mask: torch.Tensor  # [b, L-1] bool, True on response-token targets
    behav_logp: torch.Tensor  # [b, L-1] float32, 0 where mask is False
    advantages: torch.Tensor  # [b, L-1] float32, the sequence's advantage on its tokens

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]


def group_records(groups: list[Trajectory], scale: bool) -> list[SequenceRecord]:
    """GRPO advantages per group (scale=False: Dr.GRPO, mean baseline only)."""
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    adv = grpo_advantages(rewards, scale=scale)  # [G, n]
    records = []
    for g, group_adv in zip(groups, adv):
        prompt = g.prompt_ids.tolist()
        for s, a in zip(g.samples, group_adv.tolist()):
            records.append(SequenceRecord(tokens=prompt + s.response_ids.tolist(),
                                          prompt_len=len(prompt), behav_logp=s.logprobs.tolist(),
                                          advantage=a))
    return records


def pad_micro_batch(records: list[SequenceRecord]) -> MicroBatch:
    width = max(len(r.tokens) for r in records)
    b = len(records)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width - 1, dtype=torch.bool)
    behav = torch.zeros(b, width - 1, dtype=torch.float32)
    adv = torch.zeros(b, width - 1, dtype=torch.float32)
    for i, r in enumerate(records):
        n = len(r.tokens)
        input_ids[i, :n] = torch.tensor(r.tokens)
        attention[i, :n] = 1
        resp = slice(r.prompt_len - 1, n - 1)  # targets of the response tokens
        mask[i, resp] = True
        behav[i, resp] = torch.tensor(r.behav_logp)
        adv[i, resp] = r.advantage
    return MicroBatch(input_ids, attention, mask, behav, adv)


def micro_batches(records: list[SequenceRecord], size: int) -> list[MicroBatch]:
    """Split into micro-batches of at most `size` sequences, length-sorted to limit padding."""
    ordered = sorted(records, key=lambda r: len(r.tokens))
    return [pad_micro_batch(ordered[i:i + size]) for i in range(0, len(ordered), size)]
