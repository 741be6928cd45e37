"""Gathering one step's groups from the trajectories stream.

For the learner at step s (publishing version v), `Collector.collect` reads until the ranks
together hold `rollout_batch_size` complete, fresh groups:
- invalid entries were already dead-lettered by the broker; they are replaced by fresh prompts;
- an entry this rank holds unacknowledged (ready, in an incomplete group, or trained since the
  checkpoint) that Redis delivers again, because it lost the delivery in a failover or a restart,
  is skipped: it is the same entry, not a copy, and its own outcome acknowledges it;
- an entry whose `traj_id` was seen before (a retried generator) is acknowledged and counted as a
  duplicate; one whose prompt had been delivered before (`retried`: a generator died holding it, or
  Redis forgot its acknowledgement) but is not a duplicate is counted as retried (metric
  `async/retried`, run hash `prompts_retried`), so every regenerated prompt is counted one way or
  the other;
- entries are assembled into groups (learner/assemble.py: one entry per group, or one per sample
  with prompt replication); samples for an already complete group are acknowledged as late;
- a group whose oldest token is more than ceil(async_ratio) steps old is acknowledged, counted as
  stale and replaced by a fresh prompt. Age is measured in steps of the model's lineage
  (learner/lineage.py `Lineage`): without a resume, step == version;
- a group a DAPO filter rejects (`drop` returns the reason: dynamic sampling, overlong) is
  acknowledged, counted and replaced too, up to FILTER_CAP x B per step, after which groups are
  kept anyway so that a model that solves every prompt cannot make a step wait forever.
Accepted entries are NOT acknowledged here: the learner acknowledges them once the checkpoint that
contains their update is durable, so a learner crash re-delivers them. Every other entry is
recorded in the ledger (learner/ledger.py) before the call that acknowledges it, with the
outcome stale, duplicate, late, filtered, dead_lettered (rejected by validation or provenance) or
refused (its generator was quarantined: every group holding one of its entries is dropped, and
its prompts are issued again, broker/inflight.py). A trained or dropped-and-replaced group's
traj_ids leave `inflight` as it is taken (broker/trajectories.py), and a duplicate's too unless
this rank holds the first copy (a Redis that forgot the removal has it back), so rank 0's check
for lost prompts (`lost`, broker/inflight.py) sees every other issued prompt answered or held.

With several ranks, every rank reads as its own consumer and keeps the groups it accepted; after
each read the ranks exchange counts, and once they hold B groups together each rank trains a quota
of its own (learner/dist.py `split_quotas`) and keeps the rest, unacknowledged, for the next step.
Only rank 0 issues prompts; every rank records the groups it drops in the run hash's `replaced`,
atomically with their acknowledgement (learner/admission.py), so rank 0 replaces them.

Exactly-once with bounded memory. A copy of a trajectory (a retried write; a prompt answered again
after its generator died or Redis forgot an acknowledgement) has the original's `traj_id` and the
`issued_version` of the same prompt entry. The collector remembers the ids it consumed (`seen`:
read by this rank; `trained`: trained by any rank) filed under their prompt's issue step (in
lineage steps, learner/recent.py), and at every step moves a floor to `step - keep_steps`
(keep_steps = max_staleness + KEEP_MARGIN) and forgets the ids issued before it. Invariant: an
entry whose prompt was issued before the floor is dropped before the id sets are consulted
(acknowledged, counted as stale, replaced by a fresh prompt); every other entry is checked against
sets that still hold every id issued at or after the floor. So a copy is either recognised as a
duplicate or dropped as stale, and no trajectory is trained twice however long the run.
An entry below the floor is a copy of a forgotten id or a first answer more than keep_steps steps
after its prompt was issued (a prompt held by a dead generator until it was claimed again). Once
the id is forgotten the two look alike, so both are replaced: that keeps the number of prompts in
flight from shrinking when it was a first answer, and costs one extra prompt when it was a copy.
Ordinary reordering stays well inside the window (a trained group started generating at most
max_staleness steps ago, and the admission bound keeps its prompt from waiting long before that).
Incomplete groups whose prompt falls below the floor are dropped as stale and replaced as well, and
the assembler forgets completed groups below it, so the collector's memory does not grow with the
length of the run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rollflash.broker.inflight import LostPrompts
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.schema import Trajectory
from rollflash.broker.streams import Rejected
from rollflash.broker.trajectories import split_ref
from rollflash.errors import RollflashError
from rollflash.learner.admission import Admission
from rollflash.learner.assemble import Completed, GroupAssembler
from rollflash.learner.dist import Dist, split_quotas
from rollflash.learner.drops import Drops, Entries, RankProgress, traj_id_of, union
from rollflash.learner.ledger import Ledger
from rollflash.learner.lineage import Lineage
from rollflash.learner.pause import pause_point
from rollflash.learner.recent import RecentIds

log = logging.getLogger(__name__)


FILTER_CAP = 4  # at most this many batches' worth of filtered groups are replaced per step
# steps beyond max_staleness that consumed ids are remembered for (see the module docstring)
KEEP_MARGIN = 32
_BLOCK_MS = 500


class NoData(RollflashError, RuntimeError):
    """No trajectory arrived within the configured wait."""


@dataclass
class Ready:
    """An accepted group not yet trained, with the stream entries to acknowledge once it is."""

    group: Trajectory
    entry_ids: list[str]  # refs of its entries (broker/trajectories.py)
    traj_ids: list[str]  # the traj_id of each of those entries (pending until trained)


@dataclass
class Collected:
    groups: list[Trajectory] = field(default_factory=list)  # this rank's share of the step
    entry_ids: list[str] = field(default_factory=list)  # to acknowledge after the checkpoint
    part_ids: list[str] = field(default_factory=list)  # the traj_id of each of those entries
    stale_ids: list[str] = field(default_factory=list)  # ids dropped as too old (above)
    duplicate_ids: list[str] = field(default_factory=list)  # entry traj_ids seen before
    late_ids: list[str] = field(default_factory=list)  # samples for already complete groups
    retried_ids: list[str] = field(default_factory=list)  # first copies of re-delivered prompts
    filtered_ids: list[str] = field(default_factory=list)  # groups dropped by a DAPO filter
    filtered: Counter = field(default_factory=Counter)  # filter reason -> dropped groups
    rejected: int = 0
    issued: int = 0  # prompts rank 0 issued while collecting this step (admission top-ups)
    refused: int = 0  # entries of quarantined generators dropped
    wait_s: float = 0.0
    staleness: Counter = field(default_factory=Counter)  # steps of lag -> accepted groups


class Collector:
    """What a rank keeps between steps: partial groups, accepted-but-untrained groups, the ids it
    has seen, and (after a resume) the entries re-read from its pending list."""

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
    ):
        self.broker, self.admission, self.dist = broker, admission, dist
        self.vocab_size, self.max_staleness, self.timeout_s = vocab_size, max_staleness, timeout_s
        self.drop = drop
        self.lineage = lineage or Lineage()
        self.ledger, self.lost = ledger, lost  # lost: rank 0's check for lost prompts
        self.assembler = GroupAssembler(group_size)
        self.keep_steps = max_staleness + KEEP_MARGIN
        self.floor = 0  # ids of prompts issued before this step are forgotten
        self.seen = RecentIds()  # trajectory ids read by this rank
        self.trained = RecentIds()  # trajectory ids trained by any rank
        self.ready: list[Ready] = []
        self.backlog: list[tuple[str, Trajectory]] = []  # re-read pending entries, read first
        self.progress = RankProgress()  # taken into steps, acknowledged after the checkpoint
        self._send_held = False  # rank 0 asked for every rank's held traj_ids (broker/inflight.py)

    def age(self, group: Trajectory, step: int) -> int:
        return step - self.lineage.step_of(group.behavior_version)

    def issue_step(self, traj: Trajectory) -> int:
        return self.lineage.step_of(traj.issued_version)

    def restore(self, consumed: dict[int, list[str]]) -> None:
        """Take the consumed ids of a checkpoint (issue step -> ids) as seen."""
        self.seen.update((t, s) for s, ids in consumed.items() for t in ids)

    def consumed(self) -> tuple[dict[int, list[str]], list[str]]:
        """(issue step -> ids consumed, ids pending on this rank) for a checkpoint. An id pending
        here (in a ready or an incomplete group) is not final: a learner resumed from the
        checkpoint re-reads its entry and must accept it, so the checkpoint subtracts every rank's
        pending ids from the consumed ones."""
        pending = self.held()
        out: dict[int, set[str]] = {}
        for traj_id, step in self.seen.pairs() + self.trained.pairs():
            out.setdefault(step, set()).add(traj_id)
        return {s: sorted(ids) for s, ids in sorted(out.items())}, pending

    def held(self) -> list[str]:
        """The traj_ids of the entries this rank holds unacknowledged and untrained."""
        ready = [t for r in self.ready for t in r.traj_ids]
        return self.assembler.pending_traj_ids() + ready + [t.traj_id for _, t in self.backlog]

    def settle(self, drops: Drops, step: int) -> None:
        """Record `drops` in the ledger (as dropped while step + 1 was collected), then
        acknowledge them (one call)."""
        if not drops.refs and not drops.finished:
            return
        refs = [r for rs in drops.refs.values() for r in rs]
        if self.ledger is not None and refs:  # trained parts only leave `inflight`
            self.ledger.acked(step + 1, drops.outcomes, drops.refs, drops.finished, drops.replaced)
            pause_point("before_ack", step + 1)
        self.broker.ack_trajectories(refs, drops.finished, drops.replaced)

    def collect(self, step: int, version: int | None = None) -> Collected:
        """This rank's share of B fresh groups for the model at `step` (published as `version`,
        which prompts issued now are tagged with, and the newest version an entry may name;
        default `step`)."""
        version = step if version is None else version
        want = self.admission.batch_size
        out = Collected()
        started = last_arrival = time.monotonic()
        self._drop_aged(out, step)
        have = sum(self.dist.gather(len(self.ready)))
        while True:
            if self.dist.is_main:
                out.issued += self.admission.top_up(self.broker, step, version)
            if self.lost is not None:
                self.lost.before_read()
            # the ranks share what is missing, so that few groups are left over for the next step
            share = -(-(want - have) // self.dist.world_size)
            entries, rejected = self._read(share, version)
            if entries or rejected:
                last_arrival = time.monotonic()
            drops = Drops()
            self.reject(out, rejected, step)
            for entry_id, traj in self._new(entries):
                self._sort_entry(out, drops, entry_id, traj, step)
            self._refuse(out, drops)
            self.settle(drops, step)
            timed_out = time.monotonic() - last_arrival > self.timeout_s
            held = self.held() if self._send_held else None
            want_held = self.lost is not None and self.lost.want_held
            counts = self.dist.gather([len(self.ready), timed_out, held, want_held])
            if self.lost is not None:
                self.lost.after_gather(union(c[2] for c in counts))
            self._send_held = bool(counts[0][3])
            have = sum(c[0] for c in counts)
            if have >= want:
                break
            if counts[0][1]:
                raise NoData(
                    f"no trajectory arrived for {self.timeout_s:.0f}s at step {step}: "
                    "are generators running (rollctl status)?"
                )
        quota = split_quotas([c[0] for c in counts], want)[self.dist.rank]
        self._take(out, quota, step)
        if out.retried_ids:
            self.broker.count_in_run("prompts_retried", len(out.retried_ids))
        out.wait_s = time.monotonic() - started
        return out

    def _read(self, count: int, version: int) -> tuple[Entries, list[Rejected]]:
        if self.backlog:
            entries, self.backlog = self.backlog[: max(count, 1)], self.backlog[max(count, 1) :]
            return entries, []
        # each entry completes at most one group; COUNT is per stream, so a read may take up
        # to `count` from each generator: what this step does not take stays ready (pending)
        # for the next, and admission bounds it (answers to prompts issued beyond the steps)
        check = (self.vocab_size, self.assembler.group_size, version)
        return self.broker.read_trajectories(
            self.dist.consumer, count=max(count, 1), block_ms=_BLOCK_MS, check=check
        )

    def _new(self, entries: Entries) -> Entries:
        """`entries` without those this rank already holds: Redis delivers an entry again when
        it lost the delivery (a failover, a restart). It is the same entry, not a copy, so it
        is neither recorded nor acknowledged: its group's own outcome does both."""
        if not entries:
            return entries
        held = {e for r in self.ready for e in r.entry_ids} | {e for e, _ in self.backlog}
        held |= set(self.assembler.pending_entry_ids()) | set(self.progress.entry_ids)
        new = [(e, t) for e, t in entries if e not in held]
        if len(new) < len(entries):
            log.warning(
                "%d entries delivered again (Redis lost their delivery in a failover or a "
                "restart): this rank holds them already",
                len(entries) - len(new),
            )
        return new

    def reject(self, out: Collected, rejected: list[Rejected], step: int) -> None:
        """Record rejected entries, then dead-letter them (copied, acknowledged; broker)."""
        if not rejected:
            return
        out.rejected += len(rejected)
        if self.ledger is not None:
            ids = [traj_id_of(r) for r in rejected]
            refs = {"dead_lettered": [r.ref for r in rejected]}
            self.ledger.acked(step + 1, {"dead_lettered": ids}, refs, [], 0)
        self.broker.dead_letter(rejected)

    def _sort_entry(
        self, out: Collected, drops: Drops, entry_id: str, traj: Trajectory, step: int
    ) -> None:
        """File one entry under stale / duplicate / late / pending / filtered / ready; what is
        dropped goes into `drops` (acknowledged, and replaced where a group is lost)."""
        issued = self.issue_step(traj)
        t = traj.traj_id
        if issued < self.floor:  # its id may be forgotten: never trained (module docstring)
            out.stale_ids.append(t)
            return drops.add("stale", [t], [entry_id], [t], replace=1)
        if t in self.seen or t in self.trained:
            out.duplicate_ids.append(t)
            # done with unless this rank holds its first copy: `inflight` may have it back
            # (a Redis that forgot the write that removed it), and nothing else would remove it
            forget = [] if t in self.held() else [t]  # (a duplicate is rare: a list will do)
            return drops.add("duplicate", [t], [entry_id], forget)
        self.seen.add(t, issued)
        if traj.retried:  # a re-delivered prompt that is no duplicate: its first answer is lost
            out.retried_ids.append(t)
        if self.assembler.is_late(traj):
            out.late_ids.append(t)
            return drops.add("late", [t], [entry_id], [t])
        done = self.assembler.add(entry_id, traj, issued, first_seen=step)
        if done is None:
            return None  # stays pending until its group completes
        g = done.group.group_id
        if self.age(done.group, step) > self.max_staleness:
            out.stale_ids.append(g)
            return drops.add("stale", [g], done.entry_ids, done.traj_ids, replace=1)
        reason = self.drop(done.group)
        if reason is not None and len(out.filtered_ids) < FILTER_CAP * self.admission.batch_size:
            out.filtered[reason] += 1
            out.filtered_ids.append(g)
            return drops.add("filtered", [g], done.entry_ids, done.traj_ids, replace=1)
        self.ready.append(Ready(done.group, done.entry_ids, done.traj_ids))
        return None

    def _refuse(self, out: Collected, drops: Drops) -> None:
        """Drop every group holding an entry of a quarantined generator (broker/roster.py):
        acknowledged, not finished, so its prompts are issued again (broker/inflight.py)."""
        refused = self.broker.refused()
        if not refused:
            return

        def theirs(refs: list[str]) -> bool:
            return any(split_ref(r)[0] in refused for r in refs)

        kept = []
        for r in self.ready:
            if theirs(r.entry_ids):
                self._forget(r.traj_ids, r.group.group_id)
                drops.add("refused", r.traj_ids, r.entry_ids)
                out.refused += len(r.entry_ids)
            else:
                kept.append(r)
        self.ready = kept
        for c in self.assembler.remove(lambda refs, _: theirs(refs)):
            self._forget(c.traj_ids, c.group.group_id)
            drops.add("refused", c.traj_ids, c.entry_ids)
            out.refused += len(c.entry_ids)
        backlog = [(e, t) for e, t in self.backlog if split_ref(e)[0] in refused]
        if backlog:
            self.backlog = [(e, t) for e, t in self.backlog if split_ref(e)[0] not in refused]
            drops.add("refused", [t.traj_id for _, t in backlog], [e for e, _ in backlog])
            out.refused += len(backlog)

    def _forget(self, traj_ids: list[str], group_id: str) -> None:
        """Forget ids of a refused group, so that its answers issued again are not duplicates."""
        for t in traj_ids:
            self.seen.discard(t)
        self.assembler.completed.discard(group_id)

    def _drop_aged(self, out: Collected, step: int) -> None:
        """Move the floor and forget what lies below it; groups kept from an earlier step may
        have grown too old meanwhile, and incomplete groups may have fallen below the floor."""
        self.floor = max(self.floor, step - self.keep_steps)
        self.seen.forget_before(self.floor)
        self.trained.forget_before(self.floor)
        fresh: list[Ready] = []
        aged: list[Ready] = []
        for r in self.ready:
            (aged if self.age(r.group, step) > self.max_staleness else fresh).append(r)
        self.ready = fresh
        drops = Drops()
        stale: list[Ready | Completed] = [*aged, *self.assembler.forget_before(self.floor)]
        for old in stale:
            out.stale_ids.append(old.group.group_id)
            drops.add("stale", [old.group.group_id], old.entry_ids, old.traj_ids, replace=1)
        self.settle(drops, step)

    def _take(self, out: Collected, quota: int, step: int) -> None:
        """Move this rank's quota of ready groups (oldest first) into the step's batch. A group
        another rank trains in this same step (a duplicate that reached two ranks) is dropped by
        the higher rank; every rank records every trained id, so none is trained twice later.
        The taken groups' traj_ids leave `inflight` (their entries stay pending until the
        checkpoint)."""
        mine, self.ready = self.ready[:quota], self.ready[quota:]
        taken = self.dist.gather([(r.group.traj_id, self.issue_step(r.group)) for r in mine])
        earlier = {t for ids in taken[: self.dist.rank] for t, _ in ids}
        drops = Drops()
        for r in mine:
            if r.group.traj_id in earlier:
                out.duplicate_ids.append(r.group.traj_id)
                drops.add("duplicate", [r.group.traj_id], r.entry_ids)
                continue
            out.groups.append(r.group)
            out.entry_ids.extend(r.entry_ids)
            out.part_ids.extend(r.traj_ids)
            out.staleness[max(0, self.age(r.group, step))] += 1
        self.trained.update((t, s) for ids in taken for t, s in ids)
        kept = []
        for r in self.ready:  # a copy of a group another rank has just trained
            if r.group.traj_id in self.trained:
                out.duplicate_ids.append(r.group.traj_id)
                drops.add("duplicate", [r.group.traj_id], r.entry_ids)
            else:
                kept.append(r)
        self.ready = kept
        drops.finished += out.part_ids  # trained: done with their prompts (module docstring)
        self.settle(drops, step)
