"""Making a step visible: publish a version of the policy.

`publish`: rank 0 writes the policy to the weight store as a new version, records it in the run
hash and announces it over zmq (every rank helps gather FSDP shards). The weights are cast to
`trainer.publish_dtype` on the device, copied to the host once and hashed while written. With
`trainer.background_publish: process` (the default) the write runs in a helper process while the
next step collects and trains (learner/publish_process.py: the weights are copied once, from the
device straight into its shared memory, and the helper's Python work does not hold the learner's
GIL); with false it runs in the step. At most one version is in flight, and a version is announced
(run hash, zmq) only once its manifest is durable, so generators and stale-version rules never
see a partial version.

Checkpoints and resuming are in learner/checkpoint.py.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from rollflash.broker.config import Config
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.weights import WeightStore
from rollflash.errors import RunDirInUse
from rollflash.learner.device import DTYPES, resolved_dtype
from rollflash.learner.dist import Destination, is_sharded
from rollflash.learner.lora import published_weights
from rollflash.learner.publish_process import NewVersion, PublishProcess, VersionWriter

if TYPE_CHECKING:
    from rollflash.learner.build import Learner


log = logging.getLogger(__name__)


class Publisher:
    """Publishes versions in order, one at a time: in the step (`trainer.background_publish`
    false) or in a helper process (`process`, learner/publish_process.py)."""

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
        helper = cfg.trainer.background_publish == "process"
        self._process = PublishProcess(cfg, broker.lease.token or "") if helper else None
        self._writer = None if helper else VersionWriter(cfg, broker)

    def publish(self, weights: dict[str, torch.Tensor], new: NewVersion) -> float:
        """Write and announce `new` with its `weights`; returns the seconds the caller waited
        (with the helper process: for the previous version to finish and for the copy into its
        memory, not for this one)."""
        started = time.monotonic()
        if self._process is not None:
            self.wait()  # one version at a time, in order
            self._process.submit(weights, new)
        elif self._writer is not None:
            self._writer.write(weights, new)
        return time.monotonic() - started

    def ready(self) -> None:
        """Until the helper process is up (it starts while the learner does)."""
        if self._process is not None:
            self._process.ready()

    def buffers(self) -> Destination | None:
        """Where the next version's tensors go straight from the device: the helper process's
        shared memory (None in the step). Waits for the version in flight first."""
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

    def close(self) -> None:
        try:
            self.wait()
        finally:
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
    # the helper process gets its copy in its shared memory, straight from the device
    into = ln.publisher.buffers() if ln.publisher is not None and ln.dist.is_main else None
    # full weights (merged with LoRA), or the adapter and its config (learner/lora.py)
    dtype = publish_dtype(ln.cfg, ln.dist.device)
    weights, adapter = published_weights(model, ln.cfg, dtype, into=into)
    if ln.publisher is None:
        return 0.0
    ln.publisher.publish(weights, NewVersion(version, step, adapter))
    return time.monotonic() - started
