"""From a step's groups to micro-batches that carry advantages (and KL / critic inputs).

    scores [G, n] = clip(reward + soft overlong penalty)                 learner/filters.py
    scores        = REWARD_NORMS[reward_norm](scores)                    algos/rewards.py
    ref_logp      = reference model, before the update      (kl_coef > 0)
    old_values    = critic, before its update               (critic: true)
    token_rewards = -kl_coef * KL_t(behaviour || reference)  (use_kl_in_reward)
    adv, returns  = ADVANTAGE_ESTIMATORS[adv_estimator](...) over the group-major batch
    adv           = whiten(adv)                             (whiten_advantages)

    prox_logp     = policy, before the step's first update  (ppo_mini_batches x ppo_epochs > 1)

The estimators need whole groups, so everything above runs on one group-major padded batch on the
host. With `trainer.ppo_mini_batches` M > 1 the step's groups are dealt into M mini-batches, one
optimiser update each: the step's batch is the ranks' groups in rank order, and its group i goes
to mini-batch i mod M, so N ranks deal exactly the mini-batches one rank would. The micro-batches
of each mini-batch are length-sorted slices of its rows (learner/batch.py), copied to the rank's
device. Batch statistics (reward_norm batch / running, whitening, the metrics) are over every
rank's groups (learner/global_stats.py), so every rank calls `prepare_batch`, with no groups if it
has none this step. `AlgoModels` holds what the chosen
algorithm needs beside the policy, built once per learner process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollflash.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    RunningRewardNorm,
    kl_penalty,
    kl_reward_penalty,
)
from rollflash.broker.config import Config
from rollflash.broker.model_dir import model_directory
from rollflash.broker.schema import Trajectory
from rollflash.learner.batch import (
    MicroBatch,
    dummy_input,
    length_sorted_chunks,
    pad_groups,
    put,
    take,
    turn_inputs,
)
from rollflash.learner.critic import build_critic
from rollflash.learner.device import DTYPES, batch_to_device, resolved_dtype
from rollflash.learner.dist import Dist, compute_context, is_sharded
from rollflash.learner.filters import group_scores, truncated
from rollflash.learner.global_stats import global_mean, normalize_scores, whiten
from rollflash.learner.logprobs import token_logprobs
from rollflash.learner.packing import budget_chunks
from rollflash.learner.reference import AdaptersOffReference, ReferencePolicy

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


@dataclass
class PreparedBatch:
    mini_batches: list[list[MicroBatch]]  # one list of micro-batches per optimiser update
    metrics: dict[str, float]  # reward shaping, advantage and reference-KL statistics

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for mini in self.mini_batches for mb in mini]


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


def chunk_rows(full: MicroBatch, rows: torch.Tensor, cfg: Config) -> list[torch.Tensor]:
    """The micro-batches of the given rows of `full`: at most `trainer.micro_batch_size`
    sequences sorted by length, or with `trainer.token_budget` at most that many tokens."""
    if cfg.trainer.token_budget:
        return [rows[c] for c in budget_chunks(full.lengths[rows], cfg.trainer.token_budget)]
    if len(rows) == full.input_ids.shape[0]:  # the whole batch: no indirection
        return length_sorted_chunks(full, cfg.trainer.micro_batch_size)
    lengths = full.lengths[rows]
    order = rows[torch.argsort(lengths, stable=True)]
    size = cfg.trainer.micro_batch_size
    return [order[i : i + size] for i in range(0, len(order), size)]


@torch.no_grad()
def _model_inputs(
    full: MicroBatch,
    chunks: list[torch.Tensor],
    cfg: Config,
    models: AlgoModels,
    dist: Dist,
    policy: torch.nn.Module | None = None,
) -> None:
    """Fill full.ref_logp, full.old_values and (given the policy) full.prox_logp ([B, L-1]
    float32, on the host), one micro-batch at a time on the device. Sharded models gather their
    parameters in every forward pass, so every rank then runs as many passes as the busiest one
    (the extra ones on a dummy row)."""
    ref, critic = models.reference, models.critic
    packed, t, chunk = (
        cfg.trainer.token_budget > 0,
        cfg.rollout.temperature,
        cfg.trainer.logprob_chunk,
    )
    fills: list[tuple[torch.Tensor, Callable[[MicroBatch], torch.Tensor]]] = []  # (into, of)
    if ref is not None:
        full.ref_logp = torch.zeros_like(full.behav_logp)
        fills.append((full.ref_logp, lambda mb: ref.logprobs(mb, t, packed, chunk)))
    if critic is not None:
        full.old_values = torch.zeros_like(full.behav_logp)
        critic.eval()
        fills.append(
            (full.old_values, lambda mb: critic(mb.input_ids, mb.attention_mask, packed).float())
        )
    if policy is not None:
        full.prox_logp = torch.zeros_like(full.behav_logp)
        fills.append((full.prox_logp, lambda mb: proximal_logprobs(policy, mb, cfg, dist)))
    models_run = (None if ref is None else ref.model, critic, policy)
    sharded = any(m is not None and is_sharded(m) for m in models_run)
    passes = max(dist.gather(len(chunks))) if sharded else len(chunks)
    with compute_context(critic, dist, cfg.model.dtype):
        for i in range(passes):
            if i >= len(chunks):
                ids, attn = dummy_input(dist.device)
                mb = MicroBatch(ids, attn, *[torch.zeros(1, 1, device=dist.device)] * 3)
            else:
                mb = batch_to_device(take(full, chunks[i]), dist.device)
            for into, of in fills:
                values = of(mb)
                if i < len(chunks):
                    put(into, chunks[i], values.cpu())


def proximal_logprobs(
    policy: torch.nn.Module, mb: MicroBatch, cfg: Config, dist: Dist
) -> torch.Tensor:
    """[b, L-1] float32: the policy's log-probs of the sampled tokens before the step's first
    update, computed as the update computes them (same module, mode and precision), so that
    the first mini-batch's ratio is exactly 1."""
    policy.train()
    with compute_context(policy, dist, cfg.model.dtype):
        logp, _ = token_logprobs(
            policy,
            mb.input_ids,
            mb.attention_mask,
            cfg.rollout.temperature,
            packed=cfg.trainer.token_budget > 0,
            chunk=cfg.trainer.logprob_chunk,
            dtype=DTYPES[cfg.trainer.logprob_dtype],
        )
    return logp


def _advantages(
    full: MicroBatch,
    scores: torch.Tensor,
    cfg: Config,
    models: AlgoModels,
    groups: list[Trajectory],
    dist: Dist,
) -> dict[str, float]:
    """Set full.advantages (and full.returns with a critic) from group-major scores [G, n]."""
    a = cfg.algo
    normed = normalize_scores(scores, a.reward_norm, models.reward_norm, dist)  # [G, n]
    token_rewards, metrics = None, {}
    if full.ref_logp is not None:
        kl = kl_penalty(full.behav_logp, full.ref_logp, a.kl_estimator, mask=full.mask)
        metrics["kl/behav_ref_kl"] = global_mean(kl, full.mask, dist)
        if a.use_kl_in_reward:
            token_rewards = kl_reward_penalty(
                full.behav_logp, full.ref_logp, full.mask, a.kl_coef, a.kl_estimator
            )
    adv = returns = torch.zeros_like(full.behav_logp)
    if groups:  # a rank without groups still takes part in the collectives
        inputs = AdvantageInputs(
            scores=normed.reshape(-1),
            mask=full.mask,
            group_size=scores.shape[1],
            values=full.old_values,
            token_rewards=token_rewards,
            turns=turn_inputs(groups, full.mask),
        )
        out = ADVANTAGE_ESTIMATORS[a.adv_estimator](
            inputs, AdvantageConfig(gamma=a.gamma, lam=a.lam)
        )
        adv, returns = out.advantages, out.returns
    if a.adv_estimator in WHITENED_ESTIMATORS and dist.world_size > 1:
        # their whitening over the batch is over every rank's tokens, as on one rank
        adv = whiten(returns, full.mask, dist, eps=AdvantageConfig().eps)
    full.advantages = whiten(adv, full.mask, dist) if a.whiten_advantages else adv
    if models.critic is not None:
        full.returns = returns
    return {
        **metrics,
        "advantage/mean": global_mean(full.advantages, full.mask, dist),
        "advantage/abs_mean": global_mean(full.advantages.abs(), full.mask, dist),
    }


def prepare_batch(
    groups: list[Trajectory],
    cfg: Config,
    models: AlgoModels,
    dist: Dist = Dist(),
    policy: torch.nn.Module | None = None,
) -> PreparedBatch:
    """Mini-batches of micro-batches for the groups (all of size n) on `dist.device`: at most
    `trainer.micro_batch_size` sequences, or with `trainer.token_budget` at most that many
    tokens, packed (learner/packing.py). `policy`: the trained module, given when the step makes
    more than one update, for the proximal log-probs. Collective with several ranks: every rank
    calls it."""
    n = cfg.rollout.num_return_sequences
    scores = torch.stack([group_scores(g, cfg) for g in groups]) if groups else torch.zeros(0, n)
    cut = torch.cat([truncated(g) for g in groups]) if groups else torch.zeros(0, dtype=torch.bool)
    full = pad_groups(groups, keep=~cut if cfg.algo.overlong_filter else None)
    m = cfg.trainer.ppo_mini_batches
    first = sum(dist.gather(len(groups))[: dist.rank]) if m > 1 else 0
    minis = [chunk_rows(full, rows, cfg) for rows in mini_batch_rows(len(groups), n, m, first)]
    chunks = [c for mini in minis for c in mini]
    _model_inputs(full, chunks, cfg, models, dist, policy)
    metrics = _advantages(full, scores, cfg, models, groups, dist)
    raw = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    every = torch.ones(raw.shape, dtype=torch.bool)
    score_mean = global_mean(scores.reshape(-1), every, dist)
    metrics.update(
        {
            "reward/score_mean": score_mean,
            "reward/shaping_mean": score_mean - global_mean(raw, every, dist),
            "response/truncated_frac": global_mean(cut.float(), every, dist),
        }
    )
    mini_batches = [[batch_to_device(take(full, rows), dist.device) for rows in c] for c in minis]
    return PreparedBatch(mini_batches, metrics)
