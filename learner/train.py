"""One optimisation step of the policy on one collected batch.

The proximal policy of decoupled PPO is the learner's own policy at the start of the step. With one
optimiser update per step it equals the current policy's detached log-probabilities, so no second
forward pass is needed; the off-policy correction is the importance weight pi_prox / pi_behaviour
that `algos` truncates at `algo.tis_cap`.

Gradient accumulation keeps the chosen aggregation exact: each micro-batch's loss is weighted by its
share of the batch's tokens (token-mean) or sequences (the seq-mean modes).
"""

from __future__ import annotations

import torch

from algos import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs
from broker.config import Config
from learner.batch import MicroBatch


def policy_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """log pi(token_{t+1} | tokens_<=t) with logits / temperature: [b, L-1] float32."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def loss_config(cfg: Config) -> PolicyLossConfig:
    a = cfg.algo
    return PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c,
                            tis_cap=a.tis_cap, agg_mode=a.loss_agg_mode,
                            norm_len=float(cfg.rollout.max_new_tokens))


class _MetricMeans:
    """Accumulates per-micro-batch metrics: weighted means, and maxima for `*_max` names."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        for name, value in metrics.items():
            v = float(value)
            if name.endswith("_max"):
                self.values[name] = max(self.values.get(name, v), v)
            else:
                self.values[name] = self.values.get(name, 0.0) + weight * v


def mismatch_metrics(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
    """Train-inference mismatch between the learner's and the generator's log-probabilities."""
    d = (logp.detach() - behav)[mask]
    if d.numel() == 0:
        zero = torch.zeros(())
        return {"mismatch/abs_dlogp_mean": zero, "mismatch/kl": zero, "mismatch/ratio_max": zero}
    return {"mismatch/abs_dlogp_mean": d.abs().mean(),
            "mismatch/kl": (torch.exp(-d) - 1 + d).mean(),  # k3 estimate of KL(behaviour || learner)
            "mismatch/ratio_max": torch.exp(d).max()}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: list[MicroBatch], cfg: Config) -> dict[str, float]:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_fn, lcfg = POLICY_LOSSES[cfg.algo.policy_loss], loss_config(cfg)
    by_tokens = cfg.algo.loss_agg_mode == "token-mean"
    total = sum(mb.num_tokens if by_tokens else mb.num_seqs for mb in batch)
    means = _MetricMeans()
    loss_sum = 0.0
    for mb in batch:
        share = (mb.num_tokens if by_tokens else mb.num_seqs) / max(total, 1)
        logp = policy_logprobs(model, mb, cfg.rollout.temperature)
        out = loss_fn(PolicyLossInputs(logp=logp, prox_logp=logp.detach(), behav_logp=mb.behav_logp,
                                       advantages=mb.advantages, mask=mb.mask), lcfg)
        (out.loss * share).backward()
        loss_sum += float(out.loss.detach()) * share
        means.add({**out.metrics, **mismatch_metrics(logp, mb.behav_logp, mb.mask)}, share)
    max_norm = cfg.trainer.max_grad_norm if cfg.trainer.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return {"loss/policy": loss_sum, "optim/grad_norm": float(grad_norm), **means.values}
