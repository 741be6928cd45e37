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
  what the checkpoint already holds, replays the acknowledgements its ledger recorded since the
  checkpoint (learner/ledger.py) and queues this rank's other pending entries to train again.

The fault windows a test can stop the learner at (ROLLFLASH_PAUSE_AT) are in learner/pause.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflash.broker.config import Config
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.trajectories import split_ref
from rollflash.broker.weights import WeightStore
from rollflash.errors import RunDirInUse
from rollflash.learner.checkpoint import rng_state
from rollflash.learner.checkpoint_io import Trainables
from rollflash.learner.collect import Collected
from rollflash.learner.device import DTYPES, resolved_dtype
from rollflash.learner.dist import Destination, is_sharded
from rollflash.learner.ledger import refs_of, rows_since
from rollflash.learner.lora import published_weights
from rollflash.learner.pause import pause_point
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
        lease = (broker.lease.token or "") if mode == "process" else ""
        self._process = PublishProcess(cfg, lease) if mode == "process" else None
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


def publish_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """`trainer.publish_dtype`; auto is `model.dtype` on the learner's `device`, so a float32
    run publishes exactly the weights it trains (the generators' log-probs then match the
    learner's)."""
    name = cfg.trainer.publish_dtype
    return DTYPES[resolved_dtype(cfg.model.dtype, device) if name == "auto" else name]


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
    dtype = publish_dtype(ln.cfg, ln.dist.device)
    weights, adapter = published_weights(model, ln.cfg, dtype, copy, into)
    if ln.publisher is None:
        return 0.0
    ln.publisher.publish(weights, version, step, adapter)
    return time.monotonic() - started


def checkpoint(ln: Learner) -> float:
    """Make the model's current state durable, then acknowledge what it was trained on."""
    started, dist, state = time.monotonic(), ln.dist, ln.state
    consumed, pending = ln.collector.consumed()
    progress = [ln.progress.entry_ids, ln.progress.traj_ids, ln.ledger.offset()]
    parts = dist.gather([dist.consumer, *progress, consumed, pending, rng_state()])
    if dist.is_main:
        state.ranks = {
            name: {"entry_ids": ids, "traj_ids": trajs, "ledger_offset": offset}
            for name, ids, trajs, offset, *_ in parts
        }
        state.seen = _merge_consumed([p[4] for p in parts], {t for p in parts for t in p[5]})
        state.issued = ln.collector.admission.issued
        state.replaced = ln.broker.replaced_groups()
        state.reward_norm = dataclasses.asdict(ln.models.algo.reward_norm)
        state.rng = {p[0]: p[6] for p in parts}  # every rank's own generators
        state.scheduler = ln.optim.scheduler.state_dict()
        state.guards = ln.guard.state_dict()
        state.history = ln.history.to_json()
    trainables = Trainables.of(ln.models, ln.optim)
    ln.checkpoints.save(state, trainables, dist, fence=ln.broker.check_lease)  # collective
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
    already holds and what the ledger recorded since, and queue this rank's other pending
    entries to be trained again."""
    state, dist = ln.state, ln.dist
    mine = state.ranks.get(dist.consumer, {})
    since = rows_since(ln.ledger.path, mine.get("ledger_offset", 0))
    # a version the dead lineage recorded but whose publish a kill cut short is not reused either
    recorded = [r["version"] for r in since if isinstance(r.get("version"), int)]
    last = max([state.version, *recorded] + (ln.publisher.store.versions() if ln.publisher else []))
    last = dist.gather(last)[0]
    state.version = last + 1
    state.lineage.rebase(state.version, state.step)
    publish(ln, version=state.version, step=state.step)
    if dist.is_main:
        ln.broker.set_run_fields(
            version=state.version, step=state.step, state="training", resumed_from_step=state.step
        )
    done = set(mine.get("entry_ids", []))
    ln.broker.ack_trajectories(sorted(done))
    for row in (r for r in since if r.get("event") == "acked"):
        ln.broker.ack_trajectories(refs_of(row), row["finished"], row["replaced"])
        done.update(refs_of(row))
    ln.ledger.event(event="resume", step=state.step, version=state.version)
    _queue_pending(ln, done)
    log.info(
        "resumed from %s: step %d, now version %d; %d pending entries to train again",
        ckpt.name,
        state.step,
        state.version,
        len(ln.collector.backlog),
    )


def _queue_pending(ln: Learner, done: set[str]) -> None:
    """This rank's pending entries, except `done`, into the collector's backlog; invalid ones
    are recorded and dead-lettered."""
    check = (ln.models.policy.config.vocab_size, ln.cfg.rollout.num_return_sequences,
             ln.state.version)  # fmt: skip
    after: dict[str, str] = {}
    while True:
        good, bad = ln.broker.read_trajectories(ln.dist.consumer, 512, None, check, after)
        if not good and not bad:
            break
        for r, _ in good:
            after[split_ref(r)[0]] = split_ref(r)[1]
        for rejected in bad:
            after[split_ref(rejected.ref)[0]] = split_ref(rejected.ref)[1]
        ln.collector.reject(Collected(), [b for b in bad if b.ref not in done], ln.state.step)
        ln.collector.backlog += [(r, t) for r, t in good if r not in done]
