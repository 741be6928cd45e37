"""Log-probabilities (and optionally entropies) of the sampled tokens under a causal LM.

The learner scales logits by the sampling temperature, as the generators do, so that pi_learner and
pi_behaviour describe the same distribution: log pi(y) = z_y - logsumexp(z).

Memory: the model's logits [b, L, V] are in its compute dtype (bf16 under autocast). Their
log-softmax is computed over slices of `chunk` positions (`trainer.logprob_chunk`), each slice cast
to `dtype` (`trainer.logprob_dtype`) inside activation checkpointing, so at most one slice's
[b, t, V] upcast exists at a time, in the forward and in the backward pass: at a 150k vocabulary no
float32 [b, L, V] tensor is ever made. Slicing costs a second pass over the logits in the backward
pass, so it is used only where it saves memory worth having: when the whole upcast would exceed
UNSLICED_BYTES (at a 150k vocabulary that is ~110 positions, so any real batch is sliced; at the
demo's 51 tokens it is ~330k positions, so it never is). The result is float32 whatever `dtype` is,
because the PPO ratio exp(logp - logp_old) needs it. Entropy (the full softmax) is computed in the
same slices, with a gradient only when the loss uses it (`entropy_grad`).

`LogprobSpec` is the learner's one choice of these arguments for a run (temperature, packing,
slicing, upcast dtype): the proximal pass, every update and the reference compute log-probs through
it, so that two of them differ only where the weights do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from rollflash.algos import entropy_from_logits
from rollflash.learner.process.device import DTYPES
from rollflash.learner.step.packing import forward_packed, pack, unpack

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config
    from rollflash.learner.step.batch import Sequences

UNSLICED_BYTES = 64 << 20  # a [b, L, V] upcast up to this size is computed in one slice


def _slice_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, t, V] (any dtype), targets [b, t] int64 -> (logp [b, t], entropy [b, t] or an
    empty tensor) float32; without `entropy_grad` the entropy is a detached diagnostic."""
    z = logits.to(dtype) / temperature
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = (picked - torch.logsumexp(z, dim=-1)).float()
    if not with_entropy:
        return logp, logp.new_empty(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(z if entropy_grad else z.detach()).float()
    return logp, entropy


def logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    chunk: int = 0,
    dtype: torch.dtype = torch.float32,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, L, V], input_ids [b, L] int64 -> next-token logp [b, L-1] float32 (and entropy
    [b, L-1] float32, detached without `entropy_grad`). `chunk` > 0: slices of about `chunk`
    positions (chunk // b columns of every row), each recomputed in the backward pass; 0, or an
    upcast of at most UNSLICED_BYTES: one slice, kept for the backward pass."""
    b, width = input_ids.shape[0], input_ids.shape[1] - 1
    targets = input_ids[:, 1:]
    upcast = b * width * logits.shape[-1] * dtype.itemsize
    step = max(1, chunk // max(b, 1)) if chunk > 0 and upcast > UNSLICED_BYTES else width
    if step >= width:
        logp, ent = _slice_logprobs(
            logits[:, :-1], targets, temperature, dtype, with_entropy, entropy_grad
        )
        return logp, (ent if with_entropy else None)
    parts = [
        checkpoint(
            _slice_logprobs,
            logits[:, s : min(s + step, width)],
            targets[:, s : s + step],
            temperature,
            dtype,
            with_entropy,
            entropy_grad,
            use_reentrant=False,
        )
        for s in range(0, width, step)
    ]
    logp = torch.cat([p[0] for p in parts], dim=1)
    return logp, (torch.cat([p[1] for p in parts], dim=1) if with_entropy else None)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    packed: bool = False,
    chunk: int = 0,
    dtype: torch.dtype = torch.float32,
    entropy_grad: bool = True,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids, attention_mask: [b, L] int64 -> (logp [b, L-1] float32, entropy [b, L-1] float32
    or None; detached without `entropy_grad`): position t scores token t+1 given tokens 0..t.
    `packed` runs the forward pass on the sequences laid end to end without padding
    (learner/step/packing.py); the result is the same.
    `chunk`, `dtype`: `trainer.logprob_chunk` and `trainer.logprob_dtype` (see above).
    `model_inputs`: further keyword inputs of the forward pass, each [b, L, ...] per token
    (packed with the tokens)."""
    extra = dict(model_inputs or {})
    if packed:
        p = pack(input_ids, attention_mask, extra)
        logits = forward_packed(model, p).logits
        logp, entropy = logprobs_from_logits(
            logits, p.input_ids, temperature, with_entropy, chunk, dtype, entropy_grad
        )
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return unpack(logp, p, shape), (None if entropy is None else unpack(entropy, p, shape))
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra
    ).logits
    return logprobs_from_logits(
        logits, input_ids, temperature, with_entropy, chunk, dtype, entropy_grad
    )


@dataclass(frozen=True)
class LogprobSpec:
    """How the learner computes the log-probs of sampled tokens: built once from the config
    (`LogprobSpec.of`) and used by every pass that computes them."""

    temperature: float = 1.0  # rollout.temperature: the distribution the generators sampled
    packed: bool = False  # trainer.token_budget > 0: sequences laid end to end, no padding
    chunk: int = 0  # trainer.logprob_chunk: positions per log-softmax slice (0: one slice)
    dtype: torch.dtype = torch.float32  # trainer.logprob_dtype: the slices' upcast

    @classmethod
    def of(cls, cfg: Config) -> LogprobSpec:
        t = cfg.trainer
        return cls(
            cfg.rollout.temperature, t.token_budget > 0, t.logprob_chunk, DTYPES[t.logprob_dtype]
        )

    def __call__(
        self,
        model: torch.nn.Module,
        seqs: Sequences,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`token_logprobs` of the sequences' tokens (a micro-batch) under `model` with this
        spec, their `model_inputs` passed to its forward: (logp [b, L-1] float32, entropy
        [b, L-1] float32 or None)."""
        return token_logprobs(
            model,
            seqs.input_ids,
            seqs.attention_mask,
            self.temperature,
            with_entropy,
            self.packed,
            self.chunk,
            self.dtype,
            entropy_grad,
            seqs.model_inputs,
        )
