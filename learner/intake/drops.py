"""Settling what a collector does not train (learner/intake/collect.py): the entries it drops, gathered
per call by outcome with the traj_ids leaving `inflight` and the groups to replace (`Drops`), are
recorded in the ledger (learner/durability/ledger.py) before the one call that acknowledges them
(`Settler`); what it took into steps (`RankProgress`) is acknowledged after the checkpoint that
holds their update (learner/durability/checkpoint.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rollflash.broker.channels.streams import Rejected
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.durability.ledger import Ledger
from rollflash.learner.process.hooks import FaultHooks

Entries = list[tuple[str, Trajectory]]  # (ref, trajectory)


def traj_id_of(r: Rejected) -> str:
    """A rejected entry's traj_id as it says it (for the ledger), or its ref."""
    raw = r.fields.get(b"traj_id") or r.ref.encode()
    return raw[:256].decode(errors="replace")


def union(held: Iterable[list[str] | None]) -> set[str] | None:
    """Every rank's held traj_ids, or None when some rank did not send them."""
    out: set[str] = set()
    for ids in held:
        if ids is None:
            return None
        out.update(ids)
    return out


@dataclass
class Drops:
    """Entries to acknowledge in one call, by outcome, recorded in the ledger first."""

    outcomes: dict[str, list[str]] = field(default_factory=dict)  # outcome -> traj_ids
    refs: dict[str, list[str]] = field(default_factory=dict)  # outcome -> entry refs
    finished: list[str] = field(default_factory=list)  # traj_ids leaving `inflight`
    replaced: int = 0

    def add(self, outcome: str, ids: list[str], refs: list[str], parts: Sequence[str] = (),
            replace: int = 0) -> None:  # fmt: skip
        """`parts`: traj_ids the learner is done with (dropped and replaced, or late)."""
        self.outcomes.setdefault(outcome, []).extend(ids)
        self.refs.setdefault(outcome, []).extend(refs)
        self.finished += list(parts)
        self.replaced += replace


@dataclass
class RankProgress:
    """One rank's stream entries trained since the previous checkpoint (not yet acknowledged)."""

    entry_ids: list[str] = field(default_factory=list)
    traj_ids: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.entry_ids.clear()
        self.traj_ids.clear()


class Settler:
    """Records dropped entries in the ledger, then acknowledges them: the ledger before acks."""

    def __init__(self, broker: LearnerBroker, ledger: Ledger | None, hooks: FaultHooks):
        self.broker, self.ledger, self.hooks = broker, ledger, hooks

    def settle(self, drops: Drops, step: int) -> None:
        """Record `drops` (as dropped while step + 1 was collected), then acknowledge them in
        one call."""
        if not drops.refs and not drops.finished:
            return
        refs = [r for rs in drops.refs.values() for r in rs]
        if self.ledger is not None and refs:  # trained parts only leave `inflight`
            self.ledger.acked(step + 1, drops.outcomes, drops.refs, drops.finished, drops.replaced)
            self.hooks.at("before_ack", step + 1)
        self.broker.ack_trajectories(refs, drops.finished, drops.replaced)

    def dead_letter(self, rejected: list[Rejected], step: int) -> None:
        """Record entries the broker rejected, then dead-letter them (copied, acknowledged)."""
        if not rejected:
            return
        if self.ledger is not None:
            ids = [traj_id_of(r) for r in rejected]
            refs = {"dead_lettered": [r.ref for r in rejected]}
            self.ledger.acked(step + 1, {"dead_lettered": ids}, refs, [], 0)
        self.broker.dead_letter(rejected)
