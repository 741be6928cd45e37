"""One learner rank: everything it holds (`Learner`, built once by learner/build.py `start`),
and what the rank does with all of it at once: publish a version, checkpoint, resume.

The parts below hold one role each and take only what they act on: publishing the weights
(learner/durability/publish.py), the checkpoint's files and state (learner/durability/checkpoint.py,
which explains the delivery rule these functions keep), the ledger, the collector.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollflash.broker.channels.trajectories import split_ref
from rollflash.broker.config.config import Config
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.envs import Task
from rollflash.learner.durability.checkpoint import (
    CheckpointStore,
    LearnerState,
    RankShare,
    record_shares,
    rng_state,
)
from rollflash.learner.durability.checkpoint_io import Trainables
from rollflash.learner.durability.ledger import Ledger, refs_of, rows_since
from rollflash.learner.durability.publish import Publisher, publish
from rollflash.learner.evaluation.best import BestVersion
from rollflash.learner.evaluation.evaluator import Evaluator
from rollflash.learner.intake.collect import Collector
from rollflash.learner.intake.drops import RankProgress
from rollflash.learner.metrics.guards import GuardMonitor
from rollflash.learner.metrics.history import History
from rollflash.learner.metrics.metrics import MetricsSink
from rollflash.learner.models.simulated import SimulatedPolicy
from rollflash.learner.process.dist import Dist
from rollflash.learner.process.hooks import FaultHooks
from rollflash.learner.step.prepare import AlgoModels

log = logging.getLogger(__name__)


@dataclass
class Models:
    policy: torch.nn.Module  # the Hugging Face model (or SimulatedPolicy with sim.learner_step_s)
    model: torch.nn.Module  # what the ranks train: DDP around `policy`, or `policy` (FSDP: sharded)
    tokenizer: Any  # None for the simulated policy
    algo: AlgoModels  # reference, critic, running reward statistics (learner/step/prepare.py)
    # one optimiser step: learner/step/train.py `train_step`, or the simulated policy's, which takes
    # the same arguments
    train_step: Callable[..., dict[str, float]]

    @property
    def has_weights(self) -> bool:
        """False for the simulated policy (learner/models/simulated.py): it has no weights worth
        evaluating, keeping or probing."""
        return not isinstance(self.policy, SimulatedPolicy)

    @property
    def vocab_size(self) -> int:
        config: Any = self.policy.config
        return int(config.vocab_size)


@dataclass
class Optim:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Learner:
    """Everything one learner rank holds; built once by `start`."""

    cfg: Config
    dist: Dist
    broker: LearnerBroker
    task: Task
    models: Models
    optim: Optim
    collector: Collector
    checkpoints: CheckpointStore
    state: LearnerState
    guard: GuardMonitor  # reward-hacking guards, adaptive kl_coef (learner/metrics/guards.py)
    evaluator: Evaluator  # held-out evaluation between steps (learner/evaluation/evaluator.py)
    publisher: Publisher | None  # rank 0 only
    sink: MetricsSink | None  # rank 0 only
    ledger: Ledger  # every entry trained or dropped, durably before it is acknowledged
    hooks: FaultHooks  # a fault test's hooks at the fault points; none in production
    best: BestVersion | None = None  # rank 0 with eval.keep_best (learner/evaluation/best.py)
    history: History = field(default_factory=History)  # the summary's figures (checkpointed)

    @property
    def progress(self) -> RankProgress:
        """This rank's entries trained since the last checkpoint (not yet acknowledged)."""
        return self.collector.progress

    def publish(self, version: int, step: int) -> float:
        """Publish the policy as `version` (rank 0; every rank helps gather FSDP shards), with
        its probe under `weights.probe` when the policy has weights."""
        probe = self.cfg.weights.probe and self.models.has_weights
        return publish(self.models.model, self.publisher, self.dist, self.cfg, version, step, probe)

    def close(self) -> None:
        self.ledger.close()
        if self.sink is not None:
            self.sink.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.dist.is_main:
            self.broker.release()  # the run's lease: a successor may start at once
        self.dist.close()


def checkpoint(ln: Learner) -> float:
    """Make the model's current state durable, then acknowledge what it was trained on; returns
    the seconds it took."""
    started, dist, state = time.monotonic(), ln.dist, ln.state
    consumed, pending = ln.collector.consumed()
    progress = ln.progress
    offset = ln.ledger.offset()
    mine = RankShare(
        dist.consumer, progress.entry_ids, progress.traj_ids, offset, consumed, pending, rng_state()
    )
    shares: list[RankShare] = dist.gather(mine)
    if dist.is_main:
        record_shares(state, shares)
        state.issued = ln.collector.admission.issued
        state.replaced = ln.broker.replaced_groups()
        state.reward_norm = dataclasses.asdict(ln.models.algo.reward_norm)
        state.scheduler = ln.optim.scheduler.state_dict()
        state.guards = ln.guard.state_dict()
        state.history = ln.history.to_json()
    trainables = Trainables.of(ln.models, ln.optim)
    ln.checkpoints.save(state, trainables, dist, fence=ln.broker.check_lease)  # collective
    if dist.is_main:
        ln.broker.set_run_fields(checkpoint_step=state.step)
    dist.barrier()
    ln.hooks.at("after_checkpoint", state.step)
    ln.broker.ack_trajectories(ln.progress.entry_ids)
    ln.progress.clear()
    return time.monotonic() - started


def resume_after(ln: Learner, ckpt: Path | None) -> None:
    """Continue after the checkpoint (None: from step 0, the initial weights): publish it as
    the next version, acknowledge what it already holds and what the ledger recorded since, and
    queue this rank's other pending entries to be trained again."""
    state, dist = ln.state, ln.dist
    mine = state.ranks.get(dist.consumer)
    since = rows_since(ln.ledger.path, mine["ledger_offset"] if mine else 0)
    # a version the dead lineage recorded but whose publish a kill cut short is not reused either
    recorded = [r["version"] for r in since if isinstance(r.get("version"), int)]
    last = max([state.version, *recorded] + (ln.publisher.store.versions() if ln.publisher else []))
    last = dist.gather(last)[0]
    state.version = last + 1
    state.lineage.rebase(state.version, state.step)
    ln.publish(version=state.version, step=state.step)
    if dist.is_main:
        ln.broker.set_run_fields(
            version=state.version, step=state.step, state="training", resumed_from_step=state.step
        )
    done = set(mine["entry_ids"] if mine else [])
    ln.broker.ack_trajectories(sorted(done))
    for row in (r for r in since if r.get("event") == "acked"):
        ln.broker.ack_trajectories(refs_of(row), row["finished"], row["replaced"])
        done.update(refs_of(row))
    ln.ledger.event(event="resume", step=state.step, version=state.version)
    _queue_pending(ln, done)
    log.info(
        "resumed from %s: step %d, now version %d; %d pending entries to train again",
        ckpt.name if ckpt is not None else "no checkpoint (the initial weights)",
        state.step,
        state.version,
        len(ln.collector.reader.backlog),
    )


def _queue_pending(ln: Learner, done: set[str]) -> None:
    """This rank's pending entries, except `done`, into the collector's backlog; invalid ones
    are recorded and dead-lettered."""
    check = (ln.models.vocab_size, ln.cfg.rollout.num_return_sequences, ln.state.version)
    after: dict[str, str] = {}
    while True:
        good, bad = ln.broker.read_trajectories(ln.dist.consumer, 512, None, check, after)
        if not good and not bad:
            break
        for r, _ in good:
            after[split_ref(r)[0]] = split_ref(r)[1]
        for rejected in bad:
            after[split_ref(rejected.ref)[0]] = split_ref(rejected.ref)[1]
        ln.collector.settler.dead_letter([b for b in bad if b.ref not in done], ln.state.step)
        ln.collector.reader.backlog += [(r, t) for r, t in good if r not in done]
