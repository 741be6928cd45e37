"""Learner checkpoints: everything needed to resume without losing or double-training data.

- `checkpoint` (learner/rank.py, which gathers the parts of the rank it saves): model,
  optimiser, counters and the entries trained since the previous checkpoint become durable
  (sharded: each rank writes its own shard, nothing is gathered); only then are those entries
  acknowledged, so a crash re-delivers them.
- `resume_after` (learner/rank.py): a restarted learner publishes its checkpoint as the next
  version, acknowledges what the checkpoint already holds, replays the acknowledgements its
  ledger recorded since the checkpoint (learner/durability/ledger.py) and queues this rank's other
  pending entries to train again. A learner that died before its first checkpoint (after it
  published v0) made nothing durable: its successor resumes the same way from step 0 without a
  checkpoint, publishing the initial weights as the next version and replaying the whole ledger
  (learner/build.py `resume_point`).

Layout: `{run_dir}/checkpoints/step{step:08d}/` holds
- `dcp/`: a `torch.distributed.checkpoint` of the policy and its optimiser (and the critic and its
  optimiser when `algo.critic`), each rank writing its own shard (`__{rank}_0.distcp`) plus one
  `.metadata`; it loads on any number of ranks and any strategy (learner/durability/checkpoint_io.py). With
  LoRA it holds only the trainable tensors (adapters, `modules_to_save`) and their optimiser
  state: the frozen base is `model.path`, loaded again at resume;
- `state.json`: step, last published version, the version -> step lineage (learner/intake/lineage.py),
  admission counters, the lr scheduler, every rank's CPU (and CUDA) RNG state, running reward
  statistics, the adaptive KL coefficient and guard streaks (`GuardMonitor.state_dict`), the
  summary's figures (learner/metrics/history.py), the trajectory ids consumed whose prompt is recent
  enough to be remembered (`seen`: issue step -> ids, learner/intake/recent.py), and per rank the
  stream entries trained since the previous checkpoint (`rank{r}` -> entry refs and trajectory
  ids) and the size of its ledger file then (`ledger_offset`: a resume replays the ledger's
  acknowledgements from there, learner/durability/ledger.py).
A checkpoint appears by one atomic rename of a fsynced temp directory, then `LATEST` is replaced
atomically; a directory without `state.json` (written last) is never used. Both happen right
after the run's lease is checked (`fence`, broker/channels/lease.py): a learner that lost the run
publishes no checkpoint.

Delivery rule (ARCHITECTURE.md): a trajectory entry is acknowledged only after the
checkpoint that contains its effect is durable. A crash therefore leaves every entry trained after
the last checkpoint pending in the learner group; the restarted learner re-reads them and trains
them again on the checkpointed model, exactly once in the surviving lineage. Entries the checkpoint
lists as trained are acknowledged at resume (the crash may have come before their XACK) and never
trained again.

The fault points a test can stop the learner at are in learner/process/hooks.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from rollflash.broker.connect.secrets import private_subdir
from rollflash.broker.weights.weights import _fsync_dir, _fsync_file
from rollflash.learner.durability.checkpoint_io import DCP_DIR, Trainables, load_dcp, save_dcp
from rollflash.learner.intake.lineage import Lineage
from rollflash.learner.process.dist import Dist

log = logging.getLogger(__name__)

STATE = "state.json"
KEEP = 2  # checkpoints kept on disk: the newest one and its predecessor


class RankRecord(TypedDict):
    """One rank's part of a checkpoint (`LearnerState.ranks`)."""

    entry_ids: list[str]  # stream entries trained since the previous checkpoint
    traj_ids: list[str]  # their trajectory ids
    ledger_offset: int  # the size of the rank's ledger file then (learner/durability/ledger.py)


@dataclass
class LearnerState:
    step: int = 0  # optimiser updates in the model's lineage
    version: int = 0  # last published weight version
    lineage: Lineage = field(default_factory=Lineage)
    issued: int = 0  # admission: prompts ever issued
    replaced: int = 0  # admission: groups dropped and replaced
    heldout_acc_before: float = 0.0
    reward_norm: dict[str, float] = field(default_factory=dict)
    seen: dict[int, list[str]] = field(default_factory=dict)  # issue step -> ids consumed
    ranks: dict[str, RankRecord] = field(default_factory=dict)  # rank{r} -> its record
    rng: dict[str, Any] = field(default_factory=dict)  # rank{r} -> that rank's RNG states
    scheduler: dict[str, Any] = field(default_factory=dict)  # LambdaLR.state_dict()
    guards: dict[str, Any] = field(default_factory=dict)  # adaptive kl_coef, guard streaks
    trackers: dict[str, str] = field(default_factory=dict)  # backend -> tracker run id (resume)
    history: dict[str, Any] = field(default_factory=dict)  # the summary's figures (history.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "lineage": self.lineage.offsets,
            "issued": self.issued,
            "replaced": self.replaced,
            "heldout_acc_before": self.heldout_acc_before,
            "reward_norm": self.reward_norm,
            "seen": {str(s): ids for s, ids in self.seen.items()},
            "ranks": self.ranks,
            "rng": self.rng,
            "scheduler": self.scheduler,
            "guards": self.guards,
            "trackers": self.trackers,
            "history": self.history,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LearnerState:
        return cls(
            step=d["step"],
            version=d["version"],
            lineage=Lineage(d["lineage"]),
            issued=d["issued"],
            replaced=d["replaced"],
            heldout_acc_before=d["heldout_acc_before"],
            reward_norm=d["reward_norm"],
            seen={int(s): ids for s, ids in d["seen"].items()},  # JSON keys are strings
            ranks=d["ranks"],
            rng=d["rng"],
            scheduler=d["scheduler"],
            guards=d["guards"],
            trackers=d["trackers"],
            history=d["history"],
        )


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and (with a GPU) the current CUDA
    device's."""
    py = random.getstate()
    np_state: Any = np.random.get_state()  # the legacy tuple: (kind, keys, pos, ...)
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def restore_rng(states: dict[str, Any], rank: int) -> None:
    """Restore this rank's RNG states from `LearnerState.rng` (rank{r} -> `rng_state()`). A
    rank the checkpoint has no states for (the run now has more ranks) keeps its seeded
    generators."""
    state = states.get(f"rank{rank}")
    if state is None:
        log.warning("the checkpoint holds no RNG state for rank %d; keeping its seed", rank)
        return
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class CheckpointStore:
    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir) / "checkpoints"

    def step_dir(self, step: int) -> Path:
        return self.root / f"step{step:08d}"

    def latest(self) -> Path | None:
        """The checkpoint LATEST names, or else the newest complete one; None if there is none."""
        try:
            d = self.step_dir(int((self.root / "LATEST").read_text()))
            if (d / STATE).is_file():
                return d
        except (FileNotFoundError, ValueError):
            pass
        complete = sorted(d for d in self.root.glob("step*") if (d / STATE).is_file())
        return complete[-1] if complete else None

    def save(
        self,
        state: LearnerState,
        trainables: Trainables,
        dist: Dist = Dist(),
        fence: Callable[[], None] = lambda: None,
    ) -> Path:
        """Write the checkpoint of `state.step` durably (collective: every rank writes its
        shard; rank 0 writes `state.json` and, after `fence`, makes it visible); returns its
        directory."""
        final = self.step_dir(state.step)
        tmp = self.root / f".tmp-step{state.step:08d}"  # one name every rank knows
        if dist.is_main:
            private_subdir(self.root)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        save_dcp(trainables, tmp / DCP_DIR)
        dist.barrier()  # every shard is written and fsynced
        if not dist.is_main:
            return final
        (tmp / STATE).write_text(json.dumps(state.to_json()))
        _fsync_file(tmp / STATE)
        _fsync_dir(tmp / DCP_DIR)
        _fsync_dir(tmp)
        fence()
        shutil.rmtree(final, ignore_errors=True)  # a rolled-back lineage's checkpoint of this step
        os.rename(tmp, final)
        latest_tmp = self.root / f".LATEST.{os.getpid()}"
        latest_tmp.write_text(f"{state.step}\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, self.root / "LATEST")
        _fsync_dir(self.root)
        self._retain(state.step)
        return final

    def _retain(self, newest: int) -> None:
        steps = sorted(int(d.name[4:]) for d in self.root.glob("step*") if d.name[4:].isdigit())
        for s in steps[:-KEEP]:
            if s != newest:
                shutil.rmtree(self.step_dir(s), ignore_errors=True)

    def clean_temp(self) -> int:
        stale = list(self.root.glob(".tmp-*"))
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        return len(stale)

    @staticmethod
    def load(path: Path, trainables: Trainables) -> LearnerState:
        """Load the checkpoint's tensors into `trainables` (collective) and return its state."""
        state = LearnerState.from_json(json.loads((path / STATE).read_text()))
        if not (path / DCP_DIR).is_dir():
            raise FileNotFoundError(f"checkpoint {path}: no {DCP_DIR}/")
        load_dcp(trainables, path / DCP_DIR)
        return state


class RankShare(NamedTuple):
    """What each rank hands rank 0 for a checkpoint (gathered over the ranks)."""

    consumer: str  # the rank's consumer name, rank{r}
    entry_ids: list[str]  # trained since the previous checkpoint (drops.py RankProgress)
    traj_ids: list[str]
    ledger_offset: int
    consumed: dict[int, list[str]]  # issue step -> trajectory ids consumed (Collector.consumed)
    pending: list[str]  # trajectory ids this rank holds unacknowledged and untrained
    rng: dict[str, Any]  # rng_state()


def _merge_consumed(ranks: list[dict[int, list[str]]], pending: set[str]) -> dict[int, list[str]]:
    """The union of the ranks' consumed ids (issue step -> ids) without any rank's pending ones."""
    merged: dict[int, set[str]] = {}
    for consumed in ranks:
        for s, ids in consumed.items():
            merged.setdefault(s, set()).update(t for t in ids if t not in pending)
    return {s: sorted(ids) for s, ids in sorted(merged.items()) if ids}


def record_shares(state: LearnerState, shares: list[RankShare]) -> None:
    """Rank 0: every rank's share into the checkpoint's state (the entries it trained since the
    previous checkpoint, its ledger offset, its RNG), and the ids consumed by any rank that no
    rank still holds pending."""
    state.ranks = {
        r.consumer: RankRecord(
            entry_ids=r.entry_ids, traj_ids=r.traj_ids, ledger_offset=r.ledger_offset
        )
        for r in shares
    }
    held = {t for r in shares for t in r.pending}
    state.seen = _merge_consumed([r.consumed for r in shares], held)
    state.rng = {r.consumer: r.rng for r in shares}  # every rank's own generators
