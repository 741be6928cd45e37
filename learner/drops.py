"""What a collector acknowledges without training it, gathered per call (learner/collect.py):
the entries by outcome, the traj_ids leaving `inflight` and the groups to replace, recorded in
the ledger (learner/ledger.py) before the one call that acknowledges them; and what it took into
steps (`RankProgress`), acknowledged after the checkpoint that holds their update."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rollflash.broker.schema import Trajectory
from rollflash.broker.streams import Rejected

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
