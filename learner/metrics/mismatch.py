"""Train-inference mismatch per generator: how far each generator's behaviour log-probs are from
the learner's, so that one engine serving something else stands out from the others. Only
samples drawn entirely with the weights the learner holds at the step's start count: older ones
differ by the policy's own movement since (which asynchrony brings and the off-policy
correction handles), not by the engine.

`generator_mismatch` splits the step's `mismatch/kl` (the k3 estimate of KL(behaviour ||
learner) over the sampled tokens, algos/kl.py `approx_kl`) by the generator each sample came
from, as two sums per generator, `mismatch/sum/kl/<id>` and `mismatch/sum/tokens/<id>`, which add
up over micro-batches, updates and ranks (learner/metrics/metric_sums.py counts them); `per_generator`
turns the step's sums into `mismatch/kl/<id>`, the token mean, which the `mismatch_kl` guard
watches (learner/metrics/guards.py).
"""

from __future__ import annotations

import torch

from rollflash.algos.kl import kl_penalty

KL_SUM, TOKENS = "mismatch/sum/kl/", "mismatch/sum/tokens/"


def generator_mismatch(
    logp: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    generator: torch.Tensor | None,
    generators: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """Per generator, the sum of KL(behaviour || learner) over its tokens and their count.

    logp, behav: [b, T] float32, the learner's and the generator's log-probs of the sampled
    tokens; mask: [b, T] bool; generator: [b] int64, each row's index into `generators` (-1: a
    row sampled with older weights than the learner's, left out)."""
    if generator is None or not generators:
        return {}
    per_token = kl_penalty(behav.detach(), logp.detach(), "k3", mask=mask)  # [b, T], 0 off mask
    kl = torch.zeros(len(generators) + 1, dtype=per_token.dtype, device=per_token.device)
    tokens = torch.zeros_like(kl)
    at = torch.where(generator >= 0, generator, len(generators))  # the stale rows' own slot
    kl.index_add_(0, at, per_token.sum(dim=-1))
    tokens.index_add_(0, at, mask.sum(dim=-1).to(kl.dtype))
    out = {}
    for i, name in enumerate(generators):
        out[KL_SUM + name], out[TOKENS + name] = kl[i], tokens[i]
    return out


def per_generator(metrics: dict[str, float]) -> dict[str, float]:
    """`mismatch/kl/<id>` for every generator with tokens in the step's summed metrics."""
    return {
        f"mismatch/kl/{name[len(KL_SUM) :]}": value / metrics[TOKENS + name[len(KL_SUM) :]]
        for name, value in metrics.items()
        if name.startswith(KL_SUM) and metrics.get(TOKENS + name[len(KL_SUM) :], 0) > 0
    }
