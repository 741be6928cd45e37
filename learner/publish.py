"""Making a step visible and durable: publish a version, checkpoint, acknowledge, resume.

- `publish`: rank 0 writes the policy to the weight store as a new version, records it in the
  run hash and announces it over zmq (every rank helps gather FSDP shards).
- `checkpoint`: model, optimiser, counters and the entries trained since the previous checkpoint
  become durable (learner/checkpoint.py); only then are those entries acknowledged, so a crash
  re-delivers them.
- `resume_after`: a restarted learner publishes its checkpoint as the next version, acknowledges
  what the checkpoint already holds and queues this rank's other pending entries to train again.

Set ROLLFLASH_PAUSE_AT=<point>:<step> (points: after_read, after_update, after_checkpoint) and the
learner stops itself with SIGSTOP there, so a fault test can kill -9 it inside that exact window.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflash.broker.config import Config
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.notify import VersionPublisher
from rollflash.broker.weights import WeightStore
from rollflash.learner.checkpoint import RankProgress, rng_state
from rollflash.learner.dist import optimizer_state
from rollflash.learner.lora import checkpoint_weights, published_weights

if TYPE_CHECKING:
    from rollflash.learner.build import Learner

log = logging.getLogger(__name__)


class Publisher:
    """Writes a version to the weight store, records it in Redis and announces it over zmq."""

    def __init__(self, cfg: Config, broker: LearnerBroker, resuming: bool):
        self.store = WeightStore(cfg.run.run_dir)
        if self.store.versions() and not resuming:
            raise FileExistsError(
                f"run.run_dir: {cfg.run.run_dir} holds weights but no learner "
                "checkpoint to resume from; choose another run_dir or delete it"
            )
        removed = self.store.clean_temp()
        if removed:
            log.warning("removed %d partial weight versions left by an earlier crash", removed)
        self.broker = broker
        self.keep = cfg.trainer.keep_versions
        self.zmq = VersionPublisher()

    def publish(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        step: int,
        adapter_config: dict[str, Any] | None = None,
    ) -> float:
        """Publish full weights, or with `adapter_config` a LoRA adapter (broker/weights.py)."""
        started = time.monotonic()
        info = self.store.publish(weights, version, step, adapter_config=adapter_config)
        self.broker.announce_weights(version, info.path, info.sha256, self.zmq.endpoint)
        self.zmq.announce(version, info.path, info.sha256)
        self.store.retain(self.keep, in_use=self.broker.loaded_versions())
        return time.monotonic() - started

    def close(self) -> None:
        self.zmq.close()


def pause_point(name: str, step: int) -> None:
    """Stop this process here when ROLLFLASH_PAUSE_AT names this point (fault tests)."""
    if os.environ.get("ROLLFLASH_PAUSE_AT") == f"{name}:{step}":
        log.warning("pausing at %s of step %d (ROLLFLASH_PAUSE_AT)", name, step)
        os.kill(os.getpid(), signal.SIGSTOP)


def publish(ln: Learner, version: int, step: int) -> float:
    """Publish the policy as `version` (rank 0; every rank helps gather FSDP shards)."""
    weights, adapter = published_weights(ln.models.model, ln.cfg)  # adapter: LoRA (lora.py)
    if ln.publisher is None:
        return 0.0
    return ln.publisher.publish(weights, version, step, adapter)


def checkpoint(ln: Learner) -> float:
    """Make the model's current state durable, then acknowledge what it was trained on."""
    started, dist, state = time.monotonic(), ln.dist, ln.state
    consumed, pending = ln.collector.consumed()
    parts = dist.gather(
        [dist.consumer, ln.progress.entry_ids, ln.progress.traj_ids, consumed, pending]
    )
    weights = checkpoint_weights(ln.models.model)  # collective with FSDP; LoRA: adapters only
    optim = {
        "optimizer": optimizer_state(ln.models.model, ln.optim.optimizer),
        "scheduler": ln.optim.scheduler.state_dict(),
    }
    if dist.is_main:
        state.ranks = {
            name: {"entry_ids": ids, "traj_ids": trajs} for name, ids, trajs, *_ in parts
        }
        state.seen = _merge_consumed([p[3] for p in parts], {t for p in parts for t in p[4]})
        state.issued = ln.collector.admission.issued
        state.replaced = ln.broker.replaced_groups()
        state.reward_norm = dataclasses.asdict(ln.models.algo.reward_norm)
        state.rng = rng_state()
        state.guards = ln.guard.state_dict()
        critic_optimizer = ln.models.algo.critic_optimizer
        if critic_optimizer is not None:
            optim["critic_optimizer"] = critic_optimizer.state_dict()
        critic = ln.models.algo.critic
        ln.checkpoints.save(state, weights, optim, getattr(critic, "module", critic))
        ln.broker.set_run_fields(checkpoint_step=state.step)
    dist.barrier()
    pause_point("after_checkpoint", state.step)
    ln.broker.ack_trajectories(ln.progress.entry_ids)
    ln.progress.clear()
    return time.monotonic() - started


def _merge_consumed(ranks: list[dict[int, list[str]]], pending: set[str]) -> dict[int, list[str]]:
    """The union of the ranks' consumed ids (issue step -> ids) without any rank's pending ones."""
    merged: dict[int, set[str]] = {}
    for consumed in ranks:
        for s, ids in consumed.items():
            merged.setdefault(s, set()).update(t for t in ids if t not in pending)
    return {s: sorted(ids) for s, ids in sorted(merged.items()) if ids}


def resume_after(ln: Learner, ckpt: Path) -> None:
    """Continue after the checkpoint: publish it as the next version, acknowledge what it
    already holds, and queue this rank's other pending entries to be trained again."""
    state, dist = ln.state, ln.dist
    last = max([state.version] + (ln.publisher.store.versions() if ln.publisher else []))
    last = dist.gather(last)[0]
    state.version = last + 1
    state.lineage.rebase(state.version, state.step)
    publish(ln, version=state.version, step=state.step)
    if dist.is_main:
        ln.broker.set_run_fields(
            version=state.version, step=state.step, state="training", resumed_from_step=state.step
        )
    done = RankProgress(**state.ranks.get(dist.consumer, {}))
    ln.broker.ack_trajectories(done.entry_ids)
    done_ids = set(done.entry_ids)
    after = "0"
    while True:
        good, _ = ln.broker.read_trajectories(
            dist.consumer,
            count=512,
            block_ms=0,
            vocab_size=ln.models.policy.config.vocab_size,
            own_pending=True,
            after=after,
        )
        if not good:
            break
        after = good[-1][0]
        ln.collector.backlog += [(i, t) for i, t in good if i not in done_ids]
    log.info(
        "resumed from %s: step %d, now version %d; %d pending entries to train again",
        ckpt.name,
        state.step,
        state.version,
        len(ln.collector.backlog),
    )
    ln.ledger.write(
        json.dumps({"event": "resume", "step": state.step, "version": state.version}) + "\n"
    )
