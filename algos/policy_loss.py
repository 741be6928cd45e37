"""Policy-gradient losses (`policy_loss`) and their registry.

Every loss has the signature `(PolicyLossInputs, PolicyLossConfig) -> LossOutput` and:
- works on three log-probs of the sampled tokens: the current policy (with grad), the proximal policy
  (the learner's recompute before this update; the trust-region centre) and the behaviour policy (what the
  generator sampled with; see `algos/offpolicy.py`);
- multiplies each token's loss by the detached off-policy weight w ~ pi_prox / pi_behav, bounded per
  `is_mode` / `is_level` / `tis_cap`;
- reduces by `agg_mode` (`algos/aggregation.py`); masked tokens contribute exactly nothing: inputs are
  replaced by 0 there with `torch.where` before any arithmetic, so a -inf log-prob of padding can produce
  neither a NaN loss nor a NaN gradient, and an all-masked batch gives loss 0 with zero gradient.

Skipping the proximal recompute is the caller passing behav_logp as prox_logp (w = 1, PPO around the
behaviour policy; exact only on-policy).

Metrics (over selected tokens): policy/clip_frac (with policy/clip_frac_low and policy/clip_frac_high,
the tokens clipped at 1 - clip_low and at 1 + clip_high), policy/dual_clip_frac, policy/ratio_mean,
policy/ratio_max (the ratio the objective uses), policy/approx_kl (k3 estimate of KL(prox || current) from
the token ratio), and the offpolicy/* metrics of `importance_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rollflash.algos.aggregation import aggregate
from rollflash.algos.kl import approx_kl
from rollflash.algos.masked import masked_fill_zero, masked_max, masked_mean
from rollflash.algos.offpolicy import importance_weights
from rollflash.algos.ratio import exp_ratio
from rollflash.algos.types import LossOutput


@dataclass
class PolicyLossInputs:
    logp: Tensor  # [B, T] float32, current policy log-probs of the sampled tokens, requires grad
    prox_logp: (
        Tensor  # [B, T] float32, proximal policy (learner's recompute before the update), no grad
    )
    behav_logp: Tensor  # [B, T] float32, behaviour policy (what the generator sampled with)
    advantages: Tensor  # [B, T] float32
    mask: Tensor  # [B, T] bool, response tokens that count


@dataclass
class PolicyLossConfig:
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = 3.0  # dual-clip bound for A < 0 (None = off); must be > 1
    tis_cap: float | None = 2.0  # bound on pi_prox / pi_behav (None = no correction)
    agg_mode: str = "token-mean"  # see algos/aggregation.py
    is_mode: str = "truncate"  # "truncate" | "mask" (see algos/offpolicy.py)
    is_level: str = "token"  # "token" | "sequence" | "geometric"
    is_low: float | None = (
        None  # lower edge of the kept interval in "mask" mode (None = no lower edge)
    )
    norm_len: float | None = None  # constant divisor for agg_mode "seq-mean-token-sum-norm"


def _sanitised(x: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, prox_logp, behav_logp, advantages), each [B, T] with exactly 0 at masked positions."""
    if x.mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {x.mask.dtype}")
    shapes = {tuple(t.shape) for t in (x.logp, x.prox_logp, x.behav_logp, x.advantages, x.mask)}
    if len(shapes) != 1:
        raise ValueError(f"policy loss inputs must share one [B, T] shape, got {sorted(shapes)}")
    m = x.mask
    return (
        masked_fill_zero(x.logp, m),
        masked_fill_zero(x.prox_logp.detach(), m),
        masked_fill_zero(x.behav_logp.detach(), m),
        masked_fill_zero(x.advantages.detach(), m),
    )


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7), negated:

        loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))

    asymmetric bounds as DAPO's clip-higher (Yu et al. 2025, Sec. 3.1); for A < 0 additionally capped at
    -A * dual_clip_c (dual-clip, Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    eq. 5), so a huge ratio on a negative-advantage token cannot blow up the loss.

    ratio, adv: [B, T] float -> (loss [B, T], clipped [B, T] bool, dual_clipped [B, T] bool)
    """
    unclipped = -adv * ratio
    clipped_obj = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_obj)
    clipped = clipped_obj > unclipped
    if dual_clip_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    dual_bound = -adv * dual_clip_c
    dual_clipped = (adv < 0) & (loss > dual_bound)
    return torch.where(dual_clipped, dual_bound, loss), clipped, dual_clipped


def _finish(
    token_loss: Tensor,
    x: PolicyLossInputs,
    cfg: PolicyLossConfig,
    logp: Tensor,
    prox: Tensor,
    objective_ratio: Tensor,
    clipped: Tensor,
    dual_clipped: Tensor,
) -> LossOutput:
    """Weight by the off-policy correction, aggregate, and collect the shared metrics."""
    m = x.mask
    isw = importance_weights(
        x.prox_logp,
        x.behav_logp,
        m,
        mode=cfg.is_mode,
        level=cfg.is_level,
        cap=cfg.tis_cap,
        low=cfg.is_low,
    )
    loss = aggregate(isw.weight * token_loss, m, cfg.agg_mode, norm_len=cfg.norm_len)
    with torch.no_grad():
        r = objective_ratio.detach()
        metrics = {
            "policy/clip_frac": masked_mean(clipped.to(r.dtype), m),
            # the bound that bit: 1 - clip_low below the proximal policy, 1 + clip_high above it
            "policy/clip_frac_low": masked_mean((clipped & (r < 1)).to(r.dtype), m),
            "policy/clip_frac_high": masked_mean((clipped & (r > 1)).to(r.dtype), m),
            "policy/dual_clip_frac": masked_mean(dual_clipped.to(r.dtype), m),
            "policy/ratio_mean": masked_mean(r, m),
            "policy/ratio_max": masked_max(r, m),
            # KL(prox || current), as if the proximal policy had drawn the samples
            "policy/approx_kl": approx_kl(prox, logp, m),
            **isw.metrics,
        }
    return LossOutput(loss=loss, metrics=metrics)


def ppo_clip_loss(x: PolicyLossInputs, cfg: PolicyLossConfig) -> LossOutput:
    """Decoupled PPO (Hilton et al. 2022, eq. 2): clipped surrogate on r = pi / pi_prox, times the bounded
    weight pi_prox / pi_behav. With prox = behav it is PPO-clip (Schulman et al. 2017) with DAPO's
    asymmetric bounds and optional dual-clip."""
    logp, prox, _, adv = _sanitised(x)
    ratio = exp_ratio(logp - prox)
    token_loss, clipped, dual = clipped_surrogate(
        ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    )
    return _finish(token_loss, x, cfg, logp, prox, ratio, clipped, dual)


def gspo_loss(x: PolicyLossInputs, cfg: PolicyLossConfig) -> LossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7, GSPO-token form eq. 13):
    the ratio is the geometric mean over the response, s_i = exp(mean_t log(pi / pi_prox)), clipped as PPO.
    The token form s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] has the same value and, with a per-sequence
    advantage and agg_mode "seq-mean-token-mean" (the paper's), the same gradient as GSPO; per-token
    advantages are allowed. The paper's clip range is tiny (clip_low 3e-4, clip_high 4e-4); set it
    explicitly. Departure: dual_clip_c applies if set (not in the paper). A per-token off-policy weight
    (is_level "token") breaks the equivalence with sequence-level GSPO; use "sequence" or "geometric"."""
    logp, prox, _, adv = _sanitised(x)
    seq_log_ratio = masked_mean(logp - prox, x.mask, dim=-1).detach().unsqueeze(-1)  # [B, 1]
    log_s = seq_log_ratio + logp - logp.detach()  # [B, T], value = sequence log ratio
    ratio = masked_fill_zero(exp_ratio(log_s), x.mask)
    token_loss, clipped, dual = clipped_surrogate(
        ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    )
    return _finish(token_loss, x, cfg, logp, prox, ratio, clipped, dual)


def cispo_loss(x: PolicyLossInputs, cfg: PolicyLossConfig) -> LossOutput:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): clip the IS weight, not the update, and keep every token's
    gradient: loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t), r = pi / pi_prox.
    The paper effectively has no lower bound (large eps_low): use clip_low close to 1. dual_clip_c unused."""
    logp, prox, _, adv = _sanitised(x)
    ratio = exp_ratio(logp - prox)
    bounded = ratio.detach().clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = bounded != ratio.detach()
    token_loss = -bounded * adv * logp
    return _finish(token_loss, x, cfg, logp, prox, ratio, clipped, torch.zeros_like(clipped))


def topr_loss(x: PolicyLossInputs, cfg: PolicyLossConfig) -> LossOutput:
    """TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", eq. 7): tokens with A >= 0 get the plain
    REINFORCE/SFT gradient A * grad log pi (no ratio); tokens with A < 0 get it times the sequence ratio
    truncated to [0, 1], sg[min(1, prod_t pi / pi_prox)]. The paper's mu is the behaviour policy: pass
    behav_logp as prox_logp for the exact form (here the prox/behav gap goes through the off-policy
    weight). Departure: the sign test is on the advantage (the paper tests the reward). Clip bounds unused;
    policy/clip_frac counts negative tokens whose ratio was truncated."""
    logp, prox, _, adv = _sanitised(x)
    seq_log_ratio = (
        masked_fill_zero(logp - prox, x.mask).detach().sum(dim=-1, keepdim=True)
    )  # [B, 1]
    seq_ratio = exp_ratio(seq_log_ratio).expand(x.mask.shape)  # [B, T]
    negative = adv < 0
    coef = torch.where(negative, seq_ratio.clamp(max=1.0), torch.ones_like(seq_ratio))
    token_loss = -coef * adv * logp
    clipped = negative & (seq_ratio > 1.0)
    return _finish(token_loss, x, cfg, logp, prox, seq_ratio, clipped, torch.zeros_like(clipped))


def reinforce_loss(x: PolicyLossInputs, cfg: PolicyLossConfig) -> LossOutput:
    """Vanilla REINFORCE (Williams 1992): loss_t = -A_t * log pi(y_t), times the off-policy weight.
    No trust region; clip bounds unused (policy/clip_frac is 0)."""
    logp, prox, _, adv = _sanitised(x)
    ratio = exp_ratio(logp - prox)
    none = torch.zeros_like(x.mask)
    return _finish(-adv * logp, x, cfg, logp, prox, ratio, none, none)


POLICY_LOSSES: dict[str, Callable[[PolicyLossInputs, PolicyLossConfig], LossOutput]] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "topr": topr_loss,
    "reinforce": reinforce_loss,
}
