"""Making a step visible: publish a version of the policy.

`publish`: rank 0 writes the policy to the weight store as a new version, records it in the run
hash and announces it over zmq (every rank helps gather FSDP shards). The weights are cast to
`trainer.publish_dtype` on the device, copied to the host once and hashed while written. With
`trainer.background_publish: process` (the default) the write runs in a helper process while the
next step collects and trains (learner/durability/publish_process.py: the weights are copied once, from the
device straight into its shared memory, and the helper's Python work does not hold the learner's
GIL); with false it runs in the step. At most one version is in flight, and a version is announced
(run hash, zmq) only once its manifest is durable, so generators and stale-version rules never
see a partial version.

With `weights.probe` the learner also computes each version's probe (broker/weights/probe.py: the
log-probabilities of a fixed token sequence under the new policy, with every rank taking part
when the model is sharded), and rank 0 records it and, at each publish, judges the probes the
generators reported for the versions before (broker/channels/serving.py): a generator that does not
serve what it reports is quarantined within one version.

Checkpoints and resuming are in learner/durability/checkpoint.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from rollflash.broker.channels.serving import ServingCheck
from rollflash.broker.config.config import Config
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.weights.probe import probe_ids
from rollflash.broker.weights.weights import WeightStore
from rollflash.errors import RunDirInUse
from rollflash.learner.durability.publish_process import NewVersion, PublishProcess, VersionWriter
from rollflash.learner.models.lora import published_weights
from rollflash.learner.process.device import DTYPES, resolved_dtype
from rollflash.learner.process.dist import Destination, Dist, is_sharded

log = logging.getLogger(__name__)


def refuse_earlier_weights(run_dir: str) -> None:
    """`RunDirInUse` when `run_dir` holds an earlier learner's weights: a learner told to start
    over (--no-resume) would publish its versions over theirs."""
    if WeightStore(run_dir).versions():
        raise RunDirInUse(
            f"run.run_dir: {run_dir} holds an earlier learner's weights and --no-resume starts "
            "over; resume it (without --no-resume), or choose another run_dir"
        )


class Publisher:
    """Publishes versions in order, one at a time: in the step (`trainer.background_publish`
    false) or in a helper process (`process`, learner/durability/publish_process.py)."""

    def __init__(self, cfg: Config, broker: LearnerBroker, resuming: bool):
        if not resuming:
            refuse_earlier_weights(cfg.run.run_dir)
        self.store = WeightStore(cfg.run.run_dir)
        removed = self.store.clean_temp()
        if removed:
            log.warning("removed %d partial weight versions left by an earlier crash", removed)
        self.broker = broker
        helper = cfg.trainer.background_publish == "process"
        self._process = PublishProcess(cfg, broker.lease.token or "") if helper else None
        self._writer = None if helper else VersionWriter(cfg, broker)
        w = cfg.weights
        self.serving = (
            ServingCheck(broker.io, broker.roster, w.probe_tolerance) if w.probe else None
        )
        broker.serving = self.serving  # judged at every watch too, not only at a publish

    def publish(
        self, weights: dict[str, torch.Tensor], new: NewVersion, probe: Probed | None = None
    ) -> float:
        """Write and announce `new` with its `weights` (and its `probe`: values and the
        published dtype); returns the seconds the caller waited (with the helper process: for
        the previous version to finish and for the copy into its memory, not for this one)."""
        started = time.monotonic()
        if self.serving is not None:
            self.serving.check()  # the generators' reports of the versions before this one
            if probe is not None:
                self.serving.record(new.version, *probe)
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


def publish(
    model: torch.nn.Module,
    publisher: Publisher | None,
    dist: Dist,
    cfg: Config,
    version: int,
    step: int,
    probe: bool,
) -> float:
    """Publish `model` (what the ranks train) as `version` through `publisher` (rank 0's; None
    on the other ranks, which only help gather FSDP shards), with its probe when `probe`
    (`weights.probe` and a policy with weights); returns the seconds it took."""
    if not (dist.is_main or is_sharded(model)):
        return 0.0
    started = time.monotonic()
    dtype = publish_dtype(cfg, dist.device)
    probed = (learner_probe(model, cfg.run.run_id, dist.device), _name(dtype)) if probe else None
    # the helper process gets its copy in its shared memory, straight from the device
    into = publisher.buffers() if publisher is not None and dist.is_main else None
    # full weights (merged with LoRA), or the adapter and its config (learner/models/lora.py)
    weights, adapter = published_weights(model, cfg, dtype, into=into)
    if publisher is None:
        return 0.0
    publisher.publish(weights, NewVersion(version, step, adapter), probed)
    return time.monotonic() - started


Probed = tuple[list[float], str]  # a version's probe and the dtype its weights are published in


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def learner_probe(model: torch.nn.Module, run_id: str, device: torch.device) -> list[float]:
    """The probe of the policy as it is now (broker/weights/probe.py): the log-probabilities of the
    run's probe tokens, teacher-forced, at temperature 1, in float32. Every rank of a sharded
    model calls it (its forward gathers the shards); a DDP model runs its module alone."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    vocab = cast(Any, module).config.vocab_size
    ids = torch.tensor([probe_ids(run_id, vocab)], device=device)
    training = module.training
    module.eval()  # no dropout: the generators' engines have none
    try:
        logits = module(input_ids=ids).logits[0, :-1].float()
    finally:
        module.train(training)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp.cpu().tolist()
