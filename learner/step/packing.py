"""Token-budget packing: several sequences in one row, no padding (`trainer.token_budget > 0`).

Micro-batches are filled up to `token_budget` real tokens (first-fit decreasing by length) instead
of `micro_batch_size` padded rows. For the forward pass a micro-batch's sequences are laid end to
end in a single row; every sequence restarts its position ids at 0 and attends only to its own
earlier tokens. The model gets `position_ids`, `use_cache=False` and no attention mask, as in
Hugging Face's padding-free training. How the attention then keeps to each sequence depends on the
model's `attn_implementation`:
- `flash_attention_*`: the restarts give FlashAttention's variable-length kernel its boundaries.
- `sdpa`: the model is switched, once, to `sdpa_packed` (registered below): the same SDPA for
  every call that carries a mask, while a packed call runs one causal SDPA per sequence
  (`cu_seq_lens_q`, the boundaries, travels with the call, so activation-checkpointing recompute
  sees it too). Left to `sdpa`, Hugging Face would detect the restarts and build a dense
  block-diagonal [T, T] mask, and SDPA with a mask computes all T^2 scores of the row, most of
  them masked; per sequence it computes sum(n_i^2) / 2 (causal), the cost of padding-free
  attention. Models with sliding-window layers keep `sdpa` and its dense mask.
- `eager`: Hugging Face builds the block-diagonal mask from the restarts (an additive boolean mask
  given to eager attention would be 0.25 off in the logits, so none is passed here).
The per-token outputs are scattered back to the usual padded [b, L-1] layout, so losses, masks and
every aggregation mode see exactly what they would see without packing: packing changes the cost
of the forward pass, never the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_SDPA = "sdpa_packed"  # the attention implementation name registered with transformers


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] int64, the sequences end to end (T = total real tokens)
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every sequence
    rows: torch.Tensor  # [N] int64, padded-batch row of each next-token position
    cols: torch.Tensor  # [N] int64, its column in the [b, L-1] layout
    src: torch.Tensor  # [N] int64, its position in the packed [1, T-1] layout
    cu_seqlens: torch.Tensor  # [b + 1] int64, where each sequence starts in the row, then T
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # further [1, T, ...] inputs


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> Packed:
    """input_ids, attention_mask: [b, L] int64, right-padded -> one packed row. `inputs`:
    further per-token inputs of the forward pass, [b, L, ...] each, laid out as the tokens."""
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
        cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], device=input_ids.device),
        inputs={
            k: torch.cat([v[i, :n] for i, n in enumerate(lengths)])[None]
            for k, v in (inputs or {}).items()
        },
    )


def unpack(x: torch.Tensor, p: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """x: [1, T-1] packed next-token values -> [b, L-1] padded layout (0 elsewhere)."""
    out = x.new_zeros(shape)
    return out.index_put((p.rows, p.cols), x[0, p.src])


def forward_packed(model: torch.nn.Module, p: Packed) -> Any:
    """Run a Hugging Face model on a packed row: position ids, no cache, no mask (an SDPA model is
    switched to `sdpa_packed` first, see above). Returns what the model returns (its ModelOutput:
    `logits`, or a backbone's `last_hidden_state`)."""
    inner = getattr(model, "module", model)  # DistributedDataParallel wraps the HF model
    config = cast("PreTrainedModel", inner).config
    if _use_packed_sdpa(config):
        config._attn_implementation = PACKED_SDPA
        return model(
            input_ids=p.input_ids,
            position_ids=p.position_ids,
            use_cache=False,
            cu_seq_lens_q=p.cu_seqlens,
            **p.inputs,
        )
    return model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, **p.inputs)


def _use_packed_sdpa(config: object) -> bool:
    """SDPA without sliding-window layers (whose window a per-sequence causal call would not
    apply): registers `sdpa_packed` with transformers on first use."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", PACKED_SDPA):
        return False
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in layer_types:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa_mask)
    return True


def packed_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:  # transformers' mask arguments
    """Hugging Face's SDPA mask, except that a call without a 2-D attention mask and without a
    cache (queries = keys) gets none: the attention below then keeps each sequence to itself (from
    `cu_seq_lens_q` or the restarts of `position_ids`) instead of reading a dense [T, T] mask."""
    from transformers.masking_utils import sdpa_mask

    no_cache = kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("kv_offset")
    return None if kwargs.get("attention_mask") is None and no_cache else sdpa_mask(**kwargs)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None = None,  # [n + 1] int64 sequence starts, then T
    **kwargs: Any,  # transformers' attention arguments, passed on to its SDPA
) -> tuple[torch.Tensor, None]:
    """Hugging Face's SDPA attention, run once per packed sequence (causal within it) when there
    is no mask: output [1, T, H, D], as SDPA's. With a mask, or one sequence, plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _bounds(attention_mask, cu_seq_lens_q, kwargs.get("position_ids"), query.shape[2])
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if (
        query.shape[0] != 1
        or kwargs.get("sliding_window")
        or kwargs.get("position_bias") is not None
    ):
        raise ValueError("sdpa_packed: one packed row without sliding window or position bias")
    parts = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs
        )[0]
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=1), None


def _bounds(
    mask: torch.Tensor | None, cu: torch.Tensor | None, position_ids: object, length: int
) -> list[int] | None:
    """Sequence boundaries [0, ..., T] of a packed row without a mask, None if not packed. Without
    `cu_seq_lens_q` a sequence starts wherever the position ids do not go up by one, as in
    Hugging Face's packed-sequence detection."""
    if mask is not None:
        return None
    if cu is None and isinstance(position_ids, torch.Tensor):
        jumps = position_ids[:, 1:] - position_ids[:, :-1] != 1  # [b, T-1] bool
        if position_ids.shape[0] > 1 and bool(jumps.any()):
            raise ValueError("sdpa_packed: packed sequences in more than one row")
        cu = torch.tensor([0, *(jumps[0].nonzero()[:, 0] + 1).tolist(), length])
    if cu is None or len(cu) <= 2:
        return None
    return cu.tolist()


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
