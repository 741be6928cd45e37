"""Log-probabilities (and optionally entropies) of the sampled tokens under a causal LM.

The learner scales logits by the sampling temperature, as the generators do, so that pi_learner and
pi_behaviour describe the same distribution. log pi(y) = z_y - logsumexp(z) is computed without
materialising a second [b, L-1, V] tensor of log-probabilities.

Entropy needs the full softmax. For large vocabularies it is computed over slices of positions under
activation checkpointing, so at most one slice's [b, t, V] softmax is alive at a time, in the forward
and in the backward pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rollflash.algos import entropy_from_logits
from rollflash.learner.packing import forward_packed, pack, unpack

ENTROPY_CHUNK_ELEMENTS = 1 << 26  # float32 elements of softmax held at once (256 MiB)


def chunked_entropy(z: torch.Tensor, max_elements: int = ENTROPY_CHUNK_ELEMENTS) -> torch.Tensor:
    """z: [b, T, V] float32 logits (already divided by the temperature) -> [b, T] float32 entropy.

    One plain call when b * T * V <= max_elements; otherwise slices of positions, each recomputed in
    the backward pass instead of being stored.
    """
    b, t, v = z.shape
    if b * t * v <= max_elements:
        return entropy_from_logits(z)
    step = max(1, max_elements // max(b * v, 1))
    parts = [
        checkpoint(entropy_from_logits, z[:, s : s + step], use_reentrant=False)
        for s in range(0, t, step)
    ]
    return torch.cat(parts, dim=1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids, attention_mask: [b, L] int64 -> (logp [b, L-1] float32, entropy [b, L-1] float32
    or None): position t scores token t+1 given tokens 0..t. `packed` runs the forward pass on the
    sequences laid end to end without padding (learner/packing.py); the result is the same."""
    if packed:
        p = pack(input_ids, attention_mask)
        logp, entropy = _from_logits(
            forward_packed(model, p).logits, p.input_ids, temperature, with_entropy
        )
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return unpack(logp, p, shape), (unpack(entropy, p, shape) if with_entropy else None)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return _from_logits(logits, input_ids, temperature, with_entropy)


def _from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, L, V], input_ids [b, L] -> next-token logp [b, L-1] (and entropy [b, L-1])."""
    z = logits[:, :-1].float() / temperature  # [b, L-1, V]
    picked = z.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(z, dim=-1)
    return logp, (chunked_entropy(z) if with_entropy else None)
