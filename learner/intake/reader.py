"""One rank's reads of the trajectory streams (learner/intake/collect.py): the backlog first (its
pending entries re-read at resume, learner/durability/checkpoint.py), then Redis, as the rank's own
consumer. Invalid entries come back rejected (the broker validated them: broker/channels/streams.py).

An entry this rank holds already, unacknowledged (ready, in an incomplete group, or trained since
the checkpoint), that Redis delivers again because it lost the delivery in a failover or a
restart, is skipped: it is the same entry, not a copy, so it is neither recorded nor
acknowledged here; its own outcome does both."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollflash.broker.channels.streams import Rejected
from rollflash.broker.channels.trajectories import split_ref
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.learner.intake.drops import Entries
from rollflash.learner.process.dist import Dist

log = logging.getLogger(__name__)

_BLOCK_MS = 500


class EntryReader:
    def __init__(self, broker: LearnerBroker, dist: Dist, vocab_size: int, group_size: int):
        self.broker, self.dist = broker, dist
        self.vocab_size, self.group_size = vocab_size, group_size
        self.backlog: Entries = []  # re-read pending entries, read first

    def read(
        self, count: int, version: int, held: Callable[[], set[str]]
    ) -> tuple[Entries, list[Rejected]]:
        """Up to `count` entries (at least one) that are new to this rank, and the rejected
        ones; `version`: the newest an entry may name; `held`: the refs of the entries this rank
        holds outside the backlog."""
        count = max(count, 1)
        if self.backlog:
            entries, self.backlog = self.backlog[:count], self.backlog[count:]
            return self._new(entries, held), []
        # each entry completes at most one group; COUNT is per stream, so a read may take up
        # to `count` from each generator: what this step does not take stays ready (pending)
        # for the next, and admission bounds it (answers to prompts issued beyond the steps)
        check = (self.vocab_size, self.group_size, version)
        entries, rejected = self.broker.read_trajectories(
            self.dist.consumer, count=count, block_ms=_BLOCK_MS, check=check
        )
        return self._new(entries, held), rejected

    def _new(self, entries: Entries, held: Callable[[], set[str]]) -> Entries:
        """`entries` without those this rank holds already (module docstring)."""
        if not entries:
            return entries
        holding = held() | {e for e, _ in self.backlog}
        new = [(e, t) for e, t in entries if e not in holding]
        if len(new) < len(entries):
            log.warning(
                "%d entries delivered again (Redis lost their delivery in a failover or a "
                "restart): this rank holds them already",
                len(entries) - len(new),
            )
        return new

    def remove(self, generators: set[str]) -> Entries:
        """Remove and return the backlog's entries of `generators`."""
        theirs = [(e, t) for e, t in self.backlog if split_ref(e)[0] in generators]
        if theirs:
            self.backlog = [(e, t) for e, t in self.backlog if split_ref(e)[0] not in generators]
        return theirs

    def traj_ids(self) -> list[str]:
        return [t.traj_id for _, t in self.backlog]
