"""Token-budget packing: several sequences in one row, no padding (`trainer.token_budget > 0`).

Micro-batches are filled up to `token_budget` real tokens (first-fit decreasing by length) instead
of `micro_batch_size` padded rows. For the forward pass a micro-batch's sequences are laid end to
end in a single row; every sequence restarts its position ids at 0 and attends only to its own
earlier tokens. The model gets `position_ids` alone, with `use_cache=False` and no attention mask,
as in Hugging Face's padding-free training: the restarts mark the boundaries, FlashAttention and
SDPA take their variable-length paths, and eager attention builds its block-diagonal mask from
them. No dense [T, T] mask is ever built here (an additive boolean mask given to eager attention
was measured 0.25 off in the logits). The per-token outputs are scattered back
to the usual padded [b, L-1] layout, so losses, masks and every aggregation mode see exactly what
they would see without packing: packing changes the cost of the forward pass, never the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] int64, the sequences end to end (T = total real tokens)
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every sequence
    rows: torch.Tensor  # [N] int64, padded-batch row of each next-token position
    cols: torch.Tensor  # [N] int64, its column in the [b, L-1] layout
    src: torch.Tensor  # [N] int64, its position in the packed [1, T-1] layout


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """input_ids, attention_mask: [b, L] int64, right-padded -> one packed row."""
    lengths = attention_mask.sum(dim=-1).tolist()
    ids, pos, rows, cols, src = [], [], [], [], []
    offset = 0
    for i, n in enumerate(lengths):
        ids.append(input_ids[i, :n])
        pos.append(torch.arange(n, device=input_ids.device))
        # next-token positions inside this sequence only: packed t predicts packed t + 1
        rows.append(torch.full((n - 1,), i, device=input_ids.device))
        cols.append(torch.arange(n - 1, device=input_ids.device))
        src.append(torch.arange(offset, offset + n - 1, device=input_ids.device))
        offset += n
    return Packed(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        src=torch.cat(src),
    )


def unpack(x: torch.Tensor, p: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """x: [1, T-1] packed next-token values -> [b, L-1] padded layout (0 elsewhere)."""
    out = x.new_zeros(shape)
    return out.index_put((p.rows, p.cols), x[0, p.src])


def forward_packed(model: torch.nn.Module, p: Packed) -> object:
    """Run a Hugging Face model on a packed row: position ids only, no cache, no mask."""
    return model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False)


def budget_chunks(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Row indices of micro-batches holding at most `budget` tokens each (first-fit decreasing;
    a sequence longer than the budget gets a micro-batch of its own). lengths: [B] int64."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in torch.argsort(lengths, descending=True, stable=True).tolist():
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [torch.tensor(b) for b in bins]
