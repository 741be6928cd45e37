"""From a step's groups to its StepBatch and the micro-batches that train on it.

    scores [G, n] = clip(reward + soft overlong penalty)                 learner/step/filters.py
    scores        = REWARD_NORMS[reward_norm](scores)                    algos/rewards.py
    ref_logp      = reference model, before the update      (kl_coef > 0)
    old_values    = critic, before its update               (critic: true)
    prox_logp     = policy, before the step's first update  (ppo_mini_batches x ppo_epochs > 1)
    token_rewards = -kl_coef * KL_t(behaviour || reference)  (use_kl_in_reward)
    adv, returns  = ADVANTAGE_ESTIMATORS[adv_estimator](...) over the group-major batch
    adv           = whiten(adv)                             (whiten_advantages)

The step's groups are padded once on the host (learner/step/batch.py) and copied to the device once;
the passes above and the estimators run there, each returning its tensors, and the StepBatch is
built from them in one expression and not changed after. The estimators need whole groups, so
all of it is over the one group-major batch. With `trainer.ppo_mini_batches` M > 1 the step's
groups are dealt into M mini-batches, one optimiser update each: the step's batch is the ranks'
groups in rank order, and its group i goes to mini-batch i mod M, so N ranks deal exactly the
mini-batches one rank would. The micro-batches of each mini-batch are length-sorted slices of
the StepBatch's rows, on the device; their rows and widths are read on the host before the copy.
Batch statistics (reward_norm batch / running, whitening, the metrics) are over every rank's
groups (learner/step/global_stats.py), so every rank calls `prepare_batch`, with no groups if it has
none this step. `AlgoModels` holds what the chosen algorithm needs beside the policy, built once
per learner process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from rollflash.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    RunningRewardNorm,
    TurnInputs,
    kl_penalty,
    kl_reward_penalty,
    was_clamped,
)
from rollflash.broker.config.config import Config
from rollflash.broker.config.config_algo import AlgoConfig
from rollflash.broker.config.model_dir import model_directory
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.process.device import batch_to_device, resolved_dtype, to_device
from rollflash.learner.process.dist import Dist, compute_context, is_sharded
from rollflash.learner.step.batch import (
    BatchSpec,
    MicroBatch,
    Sequences,
    StepBatch,
    chunk_rows,
    dummy_input,
    mini_batch_rows,
    pad_groups,
    put,
    take,
    turn_inputs,
)
from rollflash.learner.step.critic import build_critic
from rollflash.learner.step.filters import group_scores, truncated
from rollflash.learner.step.global_stats import global_mean, normalize_scores, whiten
from rollflash.learner.step.logprobs import LogprobSpec
from rollflash.learner.step.reference import AdaptersOffReference, ReferencePolicy
from rollflash.learner.step.step_spec import StepSpec

# estimators that whiten their returns over the batch (REINFORCE++'s global normalisation)
WHITENED_ESTIMATORS = ("reinforce++", "reinforce++-baseline")


@dataclass
class AlgoModels:
    """What the algorithm needs beside the policy and its optimiser."""

    reference: ReferencePolicy | None = None  # frozen initial policy, when kl_coef > 0
    critic: torch.nn.Module | None = None  # value model (a Critic, wrapped), when algo.critic
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_norm: RunningRewardNorm = field(
        default_factory=RunningRewardNorm
    )  # reward_norm: running


def build_algo_models(
    cfg: Config, dist: Dist = Dist(), policy: torch.nn.Module | None = None
) -> AlgoModels:
    """Load the reference and build the critic only when the config uses them, on this rank's
    device, sharded with `strategy: fsdp` as the policy is; with LoRA the reference is `policy`
    (the peft model) with its adapters off."""
    models = AlgoModels()
    fsdp = cfg.trainer.strategy == "fsdp"
    if cfg.algo.kl_coef > 0 and cfg.model.lora is not None:
        assert policy is not None, "with LoRA the reference is the policy itself"
        models.reference = AdaptersOffReference(policy)
    elif cfg.algo.kl_coef > 0:
        models.reference = ReferencePolicy.load(
            model_directory(cfg.model.path),
            resolved_dtype(cfg.model.dtype, dist.device),
            dist,
            fsdp,
            cfg.model.attn_implementation,
            cfg.model.trust_remote_code,
        )
    if cfg.algo.critic:
        models.critic, models.critic_optimizer = build_critic(cfg, dist)
    return models


Chunk = tuple[torch.Tensor, int]  # a micro-batch: its rows ([k] int64), its longest row's tokens


@dataclass(frozen=True)
class PreparedBatch:
    step: StepBatch  # the whole step on the device, frozen
    mini_batches: list[list[MicroBatch]]  # slices of `step`: micro-batches of each update
    metrics: dict[str, float]  # reward shaping, advantage and reference-KL statistics

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for mini in self.mini_batches for mb in mini]


def micro_batch_layout(
    seqs: Sequences, num_groups: int, spec: BatchSpec, dist: Dist
) -> list[list[Chunk]]:
    """Each mini-batch's micro-batches of the host batch `seqs` (learner/step/batch.py
    `mini_batch_rows`, `chunk_rows`), their rows copied to `dist.device`."""
    m = spec.mini_batches
    first = sum(dist.gather(num_groups)[: dist.rank]) if m > 1 else 0
    lengths, layout = seqs.lengths, []
    for rows in mini_batch_rows(num_groups, spec.group_size, m, first):
        chunks = chunk_rows(seqs, rows, spec)
        layout.append([(to_device(c, dist.device), int(lengths[c].max())) for c in chunks])
    return layout


@torch.no_grad()
def model_passes(
    seqs: Sequences,
    chunks: list[Chunk],
    spec: StepSpec,
    models: AlgoModels,
    dist: Dist,
    policy: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """`ref_logp`, `old_values` and (given the policy) `prox_logp` as the algorithm uses them:
    [B, L-1] float32 on `seqs`' device, one micro-batch at a time. Sharded models gather their
    parameters in every forward pass, so every rank then runs as many passes as the busiest one
    (the extra ones on a dummy row)."""
    ref, critic, logprobs = models.reference, models.critic, spec.loss.logprobs
    passes: dict[str, Callable[[Sequences], torch.Tensor]] = {}
    if ref is not None:
        passes["ref_logp"] = lambda mb: ref.logprobs(mb, logprobs)
    if critic is not None:
        critic.eval()
        passes["old_values"] = lambda mb: critic(
            mb.input_ids, mb.attention_mask, logprobs.packed
        ).float()
    if policy is not None:
        passes["prox_logp"] = lambda mb: proximal_logprobs(
            policy, mb, logprobs, dist, spec.model_dtype
        )
    if not passes:
        return {}
    out = {name: torch.zeros_like(seqs.behav_logp) for name in passes}
    models_run = (None if ref is None else ref.model, critic, policy)
    sharded = any(m is not None and is_sharded(m) for m in models_run)
    count = max(dist.gather(len(chunks))) if sharded else len(chunks)
    with compute_context(critic, dist, spec.model_dtype):
        for i in range(count):
            mb = take(seqs, *chunks[i]) if i < len(chunks) else _dummy(dist.device)
            for name, of in passes.items():
                values = of(mb)
                if i < len(chunks):
                    put(out[name], chunks[i][0], values)
    return out


def _dummy(device: torch.device) -> Sequences:
    """One row of two tokens: the input of a rank's extra pass."""
    nothing = torch.zeros(1, 1, device=device)
    return Sequences(*dummy_input(device), nothing.bool(), nothing)


def proximal_logprobs(
    policy: torch.nn.Module, mb: Sequences, spec: LogprobSpec, dist: Dist, model_dtype: str
) -> torch.Tensor:
    """[b, L-1] float32: the policy's log-probs of the sampled tokens before the step's first
    update, computed as the update computes them (same module, mode, precision and `spec`), so
    that the first mini-batch's ratio is exactly 1."""
    policy.train()
    with compute_context(policy, dist, model_dtype):
        logp, _ = spec(policy, mb)
    return logp


def step_advantages(
    seqs: Sequences,
    scores: torch.Tensor,
    turns: TurnInputs | None,
    passes: Mapping[str, torch.Tensor],
    algo: AlgoConfig,
    running: RunningRewardNorm,
    dist: Dist,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """(advantages, returns with a critic, metrics) on `seqs`' device from this rank's
    group-major scores [G, n] (host), the per-turn inputs of multi-turn episodes, and the
    `model_passes` (reference log-probs, old values)."""
    normed = normalize_scores(scores, algo.reward_norm, running, dist)  # [G, n]
    ref_logp, old_values = passes.get("ref_logp"), passes.get("old_values")
    token_rewards, metrics = None, {}
    if ref_logp is not None:
        kl = kl_penalty(seqs.behav_logp, ref_logp, algo.kl_estimator, mask=seqs.mask)
        metrics["kl/behav_ref_kl"] = global_mean(kl, seqs.mask, dist)
        if algo.use_kl_in_reward:  # the penalty's k3 is clamped as the loss term's is
            token_rewards = kl_reward_penalty(
                seqs.behav_logp, ref_logp, seqs.mask, algo.kl_coef, algo.kl_estimator
            )
            clamped = was_clamped(kl, algo.kl_estimator).float()
            metrics["kl/clamped_frac"] = global_mean(clamped, seqs.mask, dist)
    adv = returns = torch.zeros_like(seqs.behav_logp)
    if scores.shape[0]:  # a rank without groups still takes part in the collectives
        inputs = AdvantageInputs(
            scores=to_device(normed.reshape(-1), seqs.mask.device),
            mask=seqs.mask,
            group_size=scores.shape[1],
            values=old_values,
            token_rewards=token_rewards,
            turns=turns,
        )
        config = AdvantageConfig(gamma=algo.gamma, lam=algo.lam)
        out = ADVANTAGE_ESTIMATORS[algo.adv_estimator](inputs, config)
        adv, returns = out.advantages, out.returns
    if algo.adv_estimator in WHITENED_ESTIMATORS and dist.world_size > 1:
        # their whitening over the batch is over every rank's tokens, as on one rank
        adv = whiten(returns, seqs.mask, dist, eps=AdvantageConfig().eps)
    if algo.whiten_advantages:
        adv = whiten(adv, seqs.mask, dist)
    metrics["advantage/mean"] = global_mean(adv, seqs.mask, dist)
    metrics["advantage/abs_mean"] = global_mean(adv.abs(), seqs.mask, dist)
    return adv, (returns if old_values is not None else None), metrics


def score_metrics(
    groups: list[Trajectory], scores: torch.Tensor, cut: torch.Tensor, dist: Dist
) -> dict[str, float]:
    """Shaped scores against the raw rewards, and the truncated share, over every rank."""
    raw = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    every = torch.ones(raw.shape, dtype=torch.bool)
    score_mean = global_mean(scores.reshape(-1), every, dist)
    return {
        "reward/score_mean": score_mean,
        "reward/shaping_mean": score_mean - global_mean(raw, every, dist),
        "response/truncated_frac": global_mean(cut.float(), every, dist),
    }


def prepare_batch(
    groups: list[Trajectory],
    spec: StepSpec,
    models: AlgoModels,
    dist: Dist = Dist(),
    policy: torch.nn.Module | None = None,
    version: int | None = None,
) -> PreparedBatch:
    """The StepBatch of the groups (all of size n) on `dist.device` and its mini-batches of
    micro-batches: at most `micro_batch_size` sequences, or with a `token_budget` at most that
    many tokens, packed (learner/step/packing.py). `policy`: the trained module, given when the step
    makes more than one update, for the proximal log-probs; `version`: the learner's at the
    step's start (`pad_groups`). Collective with several ranks: every rank calls it."""
    algo, n = spec.algo, spec.batch.group_size
    scores = (
        torch.stack([group_scores(g, spec.scores) for g in groups]) if groups else torch.zeros(0, n)
    )
    cut = torch.cat([truncated(g) for g in groups]) if groups else torch.zeros(0, dtype=torch.bool)
    host = pad_groups(groups, keep=~cut if algo.overlong_filter else None, version=version)
    turns = turn_inputs(groups, host.mask)
    minis = micro_batch_layout(host, len(groups), spec.batch, dist)
    seqs = host.to(dist.device)  # the step's one copy to the device: everything else stays there
    passes = model_passes(seqs, [c for mini in minis for c in mini], spec, models, dist, policy)
    on_device = None if turns is None else batch_to_device(turns, dist.device)
    advantages, returns, metrics = step_advantages(
        seqs, scores, on_device, passes, algo, models.reward_norm, dist
    )
    step = StepBatch.of(seqs, advantages=advantages, returns=returns, **passes)
    return PreparedBatch(
        step,
        [[step.micro_batch(rows, width) for rows, width in mini] for mini in minis],
        {**metrics, **score_metrics(groups, scores, cut, dist)},
    )
