"""Making a step visible and durable: publish a version, checkpoint, acknowledge, resume.

- `publish`: rank 0 writes the policy to the weight store as a new version, records it in the
  run hash and announces it over zmq (every rank helps gather FSDP shards). The weights are cast
  to `trainer.publish_dtype` on the device, copied to the host once and hashed while written.
  With `trainer.background_publish` the write runs while the next step collects and trains: in
  a helper process (`process`, the default, learner/publish_process.py: the weights are copied
  once, from the device straight into its shared memory, and the GIL is not shared), or in a
  thread (true); at most one version is in
  flight, and a version is announced (run hash, zmq) only once its manifest is durable, so
  generators and stale-version rules never see a partial version.
- `checkpoint`: model, optimiser, counters and the entries trained since the previous checkpoint
  become durable (learner/checkpoint.py: sharded, each rank writes its own shard, nothing is
  gathered); only then are those entries acknowledged, so a crash re-delivers them.
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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflash.broker.config import Config
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.weights import WeightStore
from rollflash.errors import RunDirInUse
from rollflash.learner.checkpoint import RankProgress, rng_state
from rollflash.learner.checkpoint_io import Trainables
from rollflash.learner.device import DTYPES
from rollflash.learner.dist import Destination, is_sharded
from rollflash.learner.lora import published_weights
from rollflash.learner.publish_process import PublishProcess, VersionWriter

if TYPE_CHECKING:
    from rollflash.learner.build import Learner


log = logging.getLogger(__name__)


class Publisher:
    """Publishes versions in order, one at a time: in the step (`trainer.background_publish`
    false), in a worker thread (true) or in a helper process (`process`,
    learner/publish_process.py)."""

    def __init__(self, cfg: Config, broker: LearnerBroker, resuming: bool):
        self.store = WeightStore(cfg.run.run_dir)
        if self.store.versions() and not resuming:
            raise RunDirInUse(
                f"run.run_dir: {cfg.run.run_dir} holds weights but no learner "
                "checkpoint to resume from; choose another run_dir or delete it"
            )
        removed = self.store.clean_temp()
        if removed:
            log.warning("removed %d partial weight versions left by an earlier crash", removed)
        self.broker = broker
        mode = cfg.trainer.background_publish
        self.threaded = mode is True
        self._process = PublishProcess(cfg) if mode == "process" else None
        self._writer = None if self._process else VersionWriter(cfg, broker)
        self._worker = ThreadPoolExecutor(1, "publish") if mode is True else None
        self._pending: Future | None = None

    def publish(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        step: int,
        adapter_config: dict[str, Any] | None = None,
    ) -> float:
        """Write and announce `version`: full weights, or with `adapter_config` a LoRA adapter
        (broker/weights.py); returns the seconds the caller waited (in the background: for the
        previous version to finish, and for the copy to the helper process, not for this one)."""
        started = time.monotonic()
        self.wait()  # one version at a time, in order
        args = (weights, version, step, adapter_config)
        if self._process is not None:
            self._process.submit(*args)
        elif self._worker is not None:
            self._pending = self._worker.submit(self._writer.write, *args)
        else:
            self._writer.write(*args)
        return time.monotonic() - started

    def ready(self) -> None:
        """Until the helper process is up (it starts while the learner does)."""
        if self._process is not None:
            self._process.ready()

    def buffers(self) -> Destination | None:
        """Where the next version's tensors go straight from the device: the helper process's
        shared memory (None in the other modes). Waits for the version in flight first."""
        if self._process is None:
            return None
        self.wait()
        return self._process.buffers

    def wait(self) -> None:
        """Until the version in flight is announced (its error, if it failed, is raised here)."""
        if self._process is not None:
            announced = self._process.wait()
            if announced is not None:  # the audit makes it again if Redis forgets it
                self.broker.remember_announced(*announced)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown()
            if self._process is not None:
                self._process.close()
            if self._writer is not None:
                self._writer.close()


def pause_point(name: str, step: int) -> None:
    """Stop this process here when ROLLFLASH_PAUSE_AT names this point (fault tests)."""
    if os.environ.get("ROLLFLASH_PAUSE_AT") == f"{name}:{step}":
        log.warning("pausing at %s of step %d (ROLLFLASH_PAUSE_AT)", name, step)
        os.kill(os.getpid(), signal.SIGSTOP)


def publish_dtype(cfg: Config) -> torch.dtype:
    """`trainer.publish_dtype`; auto is `model.dtype`, so a float32 run publishes exactly the
    weights it trains (the generators' log-probs then match the learner's)."""
    name = cfg.trainer.publish_dtype
    return DTYPES[cfg.model.dtype if name == "auto" else name]


def publish(ln: Learner, version: int, step: int) -> float:
    """Publish the policy as `version` (rank 0; every rank helps gather FSDP shards)."""
    model = ln.models.model
    if not (ln.dist.is_main or is_sharded(model)):
        return 0.0
    started = time.monotonic()
    # a thread writes them while the next step changes the parameters: it needs its own copy;
    # the helper process gets one in its shared memory, copied there straight from the device
    copy = ln.publisher is not None and ln.publisher.threaded
    into = ln.publisher.buffers() if ln.publisher is not None and ln.dist.is_main else None
    # full weights (merged with LoRA), or the adapter and its config (learner/lora.py)
    weights, adapter = published_weights(model, ln.cfg, publish_dtype(ln.cfg), copy, into)
    if ln.publisher is None:
        return 0.0
    ln.publisher.publish(weights, version, step, adapter)
    return time.monotonic() - started


def checkpoint(ln: Learner) -> float:
    """Make the model's current state durable, then acknowledge what it was trained on."""
    started, dist, state = time.monotonic(), ln.dist, ln.state
    consumed, pending = ln.collector.consumed()
    parts = dist.gather(
        [dist.consumer, ln.progress.entry_ids, ln.progress.traj_ids, consumed, pending, rng_state()]
    )
    if dist.is_main:
        state.ranks = {
            name: {"entry_ids": ids, "traj_ids": trajs} for name, ids, trajs, *_ in parts
        }
        state.seen = _merge_consumed([p[3] for p in parts], {t for p in parts for t in p[4]})
        state.issued = ln.collector.admission.issued
        state.replaced = ln.broker.replaced_groups()
        state.reward_norm = dataclasses.asdict(ln.models.algo.reward_norm)
        state.rng = {p[0]: p[5] for p in parts}  # every rank's own generators
        state.scheduler = ln.optim.scheduler.state_dict()
        state.guards = ln.guard.state_dict()
        state.history = ln.history.to_json()
    ln.checkpoints.save(state, Trainables.of(ln.models, ln.optim), dist)  # collective
    if dist.is_main:
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
