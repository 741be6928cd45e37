"""Learner checkpoints: everything needed to resume without losing or double-training data.

Layout: `{run_dir}/checkpoints/step{step:08d}/` holds
- `dcp/`: a `torch.distributed.checkpoint` of the policy and its optimiser (and the critic and its
  optimiser when `algo.critic`), each rank writing its own shard (`__{rank}_0.distcp`) plus one
  `.metadata`; it loads on any number of ranks and any strategy (learner/checkpoint_io.py). With
  LoRA it holds only the trainable tensors (adapters, `modules_to_save`) and their optimiser
  state: the frozen base is `model.path`, loaded again at resume;
- `state.json`: step, last published version, the version -> step lineage, admission counters,
  the lr scheduler, every rank's CPU (and CUDA) RNG state, running reward statistics, the
  adaptive KL coefficient and guard streaks (`GuardMonitor.state_dict`), the summary's figures
  (learner/history.py), the trajectory ids
  consumed whose prompt is recent enough to be remembered (`seen`: issue step -> ids,
  learner/collect.py), and per rank the stream entries trained since the previous checkpoint
  (`rank{r}` -> entry refs and trajectory ids) and the size of its ledger file then
  (`ledger_offset`: a resume replays the ledger's acknowledgements from there,
  learner/ledger.py). Checkpoints written before `seen` was filed by
  issue step hold a plain list; it loads as filed under the checkpoint's step, which is forgotten
  once that step falls below the collector's floor.
Checkpoints of the earlier layout (`model.safetensors`, `critic.safetensors`, `optim.pt` and one
RNG state for every rank) still load: rank 0 reads the weights and broadcasts them, every rank
reads `optim.pt` onto the CPU.
A checkpoint appears by one atomic rename of a fsynced temp directory, then `LATEST` is replaced
atomically; a directory without `state.json` (written last) is never used. Both happen right
after the run's lease is checked (`fence`, broker/lease.py): a learner that lost the run
publishes no checkpoint.

Delivery rule (ARCHITECTURE.md): a trajectory entry is acknowledged only after the
checkpoint that contains its effect is durable. A crash therefore leaves every entry trained after
the last checkpoint pending in the learner group; the restarted learner re-reads them and trains
them again on the checkpointed model, exactly once in the surviving lineage. Entries the checkpoint
lists as trained are acknowledged at resume (the crash may have come before their XACK) and never
trained again.
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
from typing import Any

import numpy as np
import torch

from rollflash.broker.weights import _fsync_dir, _fsync_file
from rollflash.learner.checkpoint_io import DCP_DIR, Trainables, load_dcp, load_legacy, save_dcp
from rollflash.learner.dist import Dist

log = logging.getLogger(__name__)

STATE = "state.json"
KEEP = 2  # checkpoints kept on disk: the newest one and its predecessor


@dataclass
class Lineage:
    """Which training step each published weight version holds.

    Without a crash version == step. After a resume from the checkpoint of step s while versions up
    to V were already published, the next version is V + 1 but holds step s + 1: versions stay
    monotonic for generators, while staleness and admission are measured in steps of the surviving
    lineage. Versions s + 1 .. V (published by the dead process) keep the steps they were published
    with, so samples drawn with them count as fresh, not as V - s steps old.
    """

    offsets: list[list[int]] = field(default_factory=lambda: [[0, 0]])  # [first_version, offset]

    def step_of(self, version: int) -> int:
        offset = 0
        for first, off in self.offsets:
            if version >= first:
                offset = off
        return version - offset

    def rebase(self, next_version: int, next_step: int) -> None:
        """From `next_version` on, version v holds step v - (next_version - next_step)."""
        self.offsets.append([next_version, next_version - next_step])


@dataclass
class RankProgress:
    """One rank's stream entries trained since the previous checkpoint (not yet acknowledged)."""

    entry_ids: list[str] = field(default_factory=list)
    traj_ids: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.entry_ids.clear()
        self.traj_ids.clear()


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
    ranks: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # rank -> RankProgress
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
            seen=_seen_from_json(d["seen"], d["step"]),
            ranks=d["ranks"],
            rng=d["rng"],
            scheduler=d.get("scheduler", {}),
            guards=d.get("guards", {}),
            trackers=d.get("trackers", {}),
            history=d.get("history", {}),
        )


def _seen_from_json(seen: list[str] | dict[str, list[str]], step: int) -> dict[int, list[str]]:
    """`seen` as issue step -> ids; the plain list of older checkpoints is filed under `step`."""
    if isinstance(seen, list):
        return {step: seen} if seen else {}
    return {int(s): ids for s, ids in seen.items()}


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and (with a GPU) the current CUDA
    device's."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def restore_rng(state: dict[str, Any], rank: int = 0) -> None:
    """Restore this rank's RNG states from `LearnerState.rng` (rank{r} -> states). The earlier
    layout held rank 0's states only: every rank restores those. A rank the checkpoint has no
    states for (the run now has more ranks) keeps its seeded generators."""
    if not state:
        return
    if "python" not in state:
        if f"rank{rank}" not in state:
            log.warning("the checkpoint holds no RNG state for rank %d; keeping its seed", rank)
            return
        state = state[f"rank{rank}"]
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
            self.root.mkdir(parents=True, exist_ok=True)
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
    def load(path: Path, trainables: Trainables, dist: Dist = Dist()) -> LearnerState:
        """Load the checkpoint's tensors into `trainables` (collective) and return its state."""
        state = LearnerState.from_json(json.loads((path / STATE).read_text()))
        if (path / DCP_DIR).is_dir():
            load_dcp(trainables, path / DCP_DIR)
        elif (path / "optim.pt").is_file():
            log.info("loading %s, a checkpoint of the layout before sharded checkpoints", path)
            load_legacy(trainables, path, dist)
        else:
            raise FileNotFoundError(f"checkpoint {path}: neither {DCP_DIR}/ nor optim.pt")
        return state
