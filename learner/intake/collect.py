"""Gathering one step's groups from the trajectory streams.

For the learner at step s, `Collector.collect` reads until the ranks together hold
`rollout_batch_size` (B) complete, fresh groups, running one rank's stages, each in its file:

    drops = triage.drop_aged(step)           # learner/intake/triage.py: the floor moves; aged groups go
    repeat:
        admission.top_up(...)                # rank 0 issues prompts (learner/intake/admission.py)
        entries = reader.read(share)         # learner/intake/reader.py: backlog, then Redis; skips
                                             #   entries Redis delivers again
        triage.entry(each), triage.refuse()  # stale, duplicate (learner/intake/recent.py), late,
                                             #   pending (learner/intake/assemble.py), filtered, ready
                                             #   (learner/intake/ready.py), refused
        settler.settle(drops)                # learner/intake/drops.py: the ledger, then one XACK
        counts = every rank's ready groups   # until the ranks hold B together
    taker.take(quota)                        # learner/intake/take.py: this rank's share, oldest first

Accepted entries are not acknowledged here: the learner acknowledges them once the checkpoint
that contains their update is durable, so a learner crash re-delivers them. Every other entry is
recorded in the ledger (learner/durability/ledger.py) before the call that acknowledges it. Only rank 0
issues prompts; every rank records the groups it drops in the run hash's `replaced`, atomically
with their acknowledgement (learner/intake/admission.py), so rank 0 replaces them. Why this trains every
trajectory at most once with bounded memory, and records every acknowledged entry exactly once:
docs/faults.md, "Exactly-once intake".
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollflash.broker.channels.inflight import LostPrompts
from rollflash.broker.channels.streams import Rejected
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import Trajectory
from rollflash.errors import RollflashError
from rollflash.learner.durability.ledger import Ledger
from rollflash.learner.intake.admission import Admission
from rollflash.learner.intake.assemble import GroupAssembler
from rollflash.learner.intake.collected import Collected
from rollflash.learner.intake.drops import Drops, Entries, RankProgress, Settler, union
from rollflash.learner.intake.lineage import Lineage
from rollflash.learner.intake.reader import EntryReader
from rollflash.learner.intake.ready import ReadyGroups
from rollflash.learner.intake.recent import ConsumedIds
from rollflash.learner.intake.take import Taker
from rollflash.learner.intake.triage import FILTER_CAP, Triage
from rollflash.learner.metrics.lengths import length_metrics
from rollflash.learner.process.dist import Dist
from rollflash.learner.process.hooks import FaultHooks


class NoData(RollflashError, RuntimeError):
    """No trajectory arrived within the configured wait."""


class Collector:
    """What a rank keeps between steps: partial groups, accepted-but-untrained groups, the ids it
    has consumed, and (after a resume) the entries re-read from its pending list."""

    def __init__(
        self,
        broker: LearnerBroker,
        admission: Admission,
        group_size: int,
        vocab_size: int,
        max_staleness: int,
        timeout_s: float,
        drop: Callable[[Trajectory], str | None] = lambda g: None,
        dist: Dist = Dist(),
        lineage: Lineage | None = None,
        ledger: Ledger | None = None,
        lost: LostPrompts | None = None,
        max_overdue: int | None = None,
        hooks: FaultHooks = FaultHooks(),
    ):
        """`max_staleness` and `max_overdue` (default: max_staleness): learner/intake/ready.py; `lost`:
        rank 0's check for lost prompts (broker/channels/inflight.py)."""
        self.broker, self.admission, self.dist = broker, admission, dist
        self.timeout_s, self.lost, self.hooks = timeout_s, lost, hooks
        lineage = lineage or Lineage()
        max_overdue = max_staleness if max_overdue is None else max_overdue
        self.assembler = GroupAssembler(group_size)
        self.ready = ReadyGroups(lineage, max_staleness, max_overdue)
        self.ids = ConsumedIds(max_overdue)
        self.reader = EntryReader(broker, dist, vocab_size, group_size)
        cap = FILTER_CAP * admission.batch_size
        self.triage = Triage(self.ids, self.assembler, self.ready, lineage, drop, cap, self.held)
        self.taker = Taker(self.ready, self.ids, dist, lineage)
        self.settler = Settler(broker, ledger, hooks)
        self.progress = RankProgress()  # taken into steps, acknowledged after the checkpoint
        self._send_held = (
            False  # rank 0 asked for every rank's held traj_ids (broker/channels/inflight.py)
        )

    def restore(self, consumed: dict[int, list[str]]) -> None:
        """Take the consumed ids of a checkpoint (issue step -> ids) as seen."""
        self.ids.restore(consumed)

    def consumed(self) -> tuple[dict[int, list[str]], list[str]]:
        """(issue step -> ids consumed, ids pending on this rank) for a checkpoint. An id pending
        here (in a ready or an incomplete group) is not final: a learner resumed from the
        checkpoint re-reads its entry and must accept it, so the checkpoint subtracts every rank's
        pending ids from the consumed ones."""
        return self.ids.by_step(), self.held()

    def held(self) -> list[str]:
        """The traj_ids of the entries this rank holds unacknowledged and untrained."""
        ready = self.ready.traj_ids()
        return self.assembler.pending_traj_ids() + ready + self.reader.traj_ids()

    def _held_entries(self) -> set[str]:
        """The refs of the entries this rank holds unacknowledged, outside the backlog."""
        held = self.ready.entry_ids() | set(self.assembler.pending_entry_ids())
        return held | set(self.progress.entry_ids)

    def collect(self, step: int, version: int | None = None) -> Collected:
        """This rank's share of B fresh groups for the model at `step` (published as `version`,
        which prompts issued now are tagged with, and the newest version an entry may name;
        default `step`)."""
        version = step if version is None else version
        want = self.admission.batch_size
        out = Collected()
        started = last_arrival = time.monotonic()
        self.settler.settle(self.triage.drop_aged(out, step), step)
        have = sum(self.dist.gather(len(self.ready)))
        while True:
            if self.dist.is_main:
                out.issued += self.admission.top_up(self.broker, step, version)
            if self.lost is not None:
                self.lost.before_read()
            # the ranks share what is missing, so that few groups are left over for the next step
            share = -(-(want - have) // self.dist.world_size)
            entries, rejected = self.reader.read(share, version, self._held_entries)
            if entries or rejected:
                last_arrival = time.monotonic()
            self._sort(out, entries, rejected, step)
            counts = self._exchange(step, time.monotonic() - last_arrival > self.timeout_s)
            have = sum(c[0] for c in counts)
            if have >= want:
                break
            if counts[0][1]:
                raise NoData(
                    f"no trajectory arrived for {self.timeout_s:.0f}s at step {step}: "
                    "are generators running (rollctl status)?"
                )
        quota = self.taker.quota([c[0] for c in counts], [c[4] for c in counts], want)
        self.settler.settle(self.taker.take(quota, step, out), step)
        ranks = self.dist.gather([out.tally.counts(), out.overdue])
        out.step_wide = length_metrics([c for c, _ in ranks])
        out.step_wide["async/overdue"] = sum(n for _, n in ranks)
        if out.retried_ids:
            self.broker.count_in_run("prompts_retried", len(out.retried_ids))
        out.wait_s = time.monotonic() - started
        self.hooks.at("after_read", step + 1)
        return out

    def _sort(self, out: Collected, entries: Entries, rejected: list[Rejected], step: int) -> None:
        """Dead-letter the rejected entries, file the new ones, drop what quarantined generators
        sent, and settle what was dropped."""
        out.rejected += len(rejected)
        self.settler.dead_letter(rejected, step)
        drops = Drops()
        for entry_id, traj in entries:
            self.triage.entry(out, drops, entry_id, traj, step)
        refused = self.broker.refused()
        if refused:
            self.triage.refuse(refused, self.reader.remove(refused), out, drops)
        self.settler.settle(drops, step)

    def _exchange(self, step: int, timed_out: bool) -> list[list]:
        """Every rank's [ready groups, timed out, held traj_ids (when rank 0 asked for them),
        whether rank 0 asks for them next, groups due at `step`] (collective); rank 0's check
        for lost prompts takes the held ids."""
        held = self.held() if self._send_held else None
        want_held = self.lost is not None and self.lost.want_held
        counts = self.dist.gather(
            [len(self.ready), timed_out, held, want_held, self.ready.due(step)]
        )
        if self.lost is not None:
            self.lost.after_gather(union(c[2] for c in counts))
        self._send_held = bool(counts[0][3])
        return counts
