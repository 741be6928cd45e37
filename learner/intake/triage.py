"""What becomes of each entry a rank reads, and of the groups it holds (learner/intake/collect.py).

`entry` files one new entry, checking in this order:
- stale: its prompt was issued before the floor of the remembered ids (learner/intake/recent.py), so its
  id may be forgotten: dropped and replaced by a fresh prompt, never trained;
- duplicate: its traj_id was consumed before (a retried write, a prompt answered again): dropped.
  One that is no duplicate but whose prompt was delivered before (`retried`: a generator died
  holding it, or Redis forgot its acknowledgement) is counted as retried, so every regenerated
  prompt is counted one way or the other;
- late: a sample for a group already complete (learner/intake/assemble.py): dropped;
- pending: its group is still incomplete;
- stale: its completed group is older than the ready groups' rules allow (learner/intake/ready.py):
  dropped and replaced;
- filtered: a DAPO filter rejects the group (`drop` returns the reason, learner/step/filters.py):
  dropped and replaced, up to FILTER_CAP x B groups per step, after which groups are kept anyway
  so that a model that solves every prompt cannot make a step wait forever;
- ready: accepted, and counted as overdue when older than max_staleness.
`refuse` drops every group holding an entry of a quarantined generator (broker/channels/roster.py), not
replaced: its prompts are issued again (broker/channels/inflight.py). `drop_aged` moves the floor and
drops the groups kept past their last step and the incomplete ones below the floor, as stale.
Everything dropped goes into a `Drops` (learner/intake/drops.py) for the settler; docs/faults.md
("Exactly-once intake") explains why this keeps every entry trained or recorded exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

from rollflash.broker.channels.trajectories import split_ref
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.intake.assemble import Completed, GroupAssembler
from rollflash.learner.intake.collected import Collected
from rollflash.learner.intake.drops import Drops, Entries
from rollflash.learner.intake.lineage import Lineage
from rollflash.learner.intake.ready import Ready, ReadyGroups
from rollflash.learner.intake.recent import ConsumedIds

FILTER_CAP = 4  # at most this many batches' worth of filtered groups are replaced per step


class Triage:
    def __init__(
        self,
        ids: ConsumedIds,
        assembler: GroupAssembler,
        ready: ReadyGroups,
        lineage: Lineage,
        drop: Callable[[Trajectory], str | None],
        filter_cap: int,
        held: Callable[[], list[str]],
    ):
        """`filter_cap`: filtered groups replaced per step; `held`: the traj_ids the rank holds
        unacknowledged and untrained."""
        self.ids, self.assembler, self.ready, self.lineage = ids, assembler, ready, lineage
        self.drop, self.filter_cap, self.held = drop, filter_cap, held

    def entry(
        self, out: Collected, drops: Drops, entry_id: str, traj: Trajectory, step: int
    ) -> None:
        """File one new entry (module docstring); what is dropped goes into `drops`."""
        issued = self.lineage.step_of(traj.issued_version)
        t = traj.traj_id
        verdict = self.ids.consume(t, issued)
        if verdict == "stale":
            out.tally.add("stale", traj)
            out.stale_ids.append(t)
            return drops.add("stale", [t], [entry_id], [t], replace=1)
        if verdict == "duplicate":
            out.duplicate_ids.append(t)
            # done with unless this rank holds its first copy: `inflight` may have it back
            # (a Redis that forgot the write that removed it), and nothing else would remove it
            forget = [] if t in self.held() else [t]  # (a duplicate is rare: a list will do)
            return drops.add("duplicate", [t], [entry_id], forget)
        if traj.retried:  # a re-delivered prompt that is no duplicate: its first answer is lost
            out.retried_ids.append(t)
        if self.assembler.is_late(traj):
            out.late_ids.append(t)
            return drops.add("late", [t], [entry_id], [t])
        done = self.assembler.add(entry_id, traj, issued, first_seen=step)
        if done is not None:  # else it stays pending until its group completes
            self._group(out, drops, done, step)
        return None

    def _group(self, out: Collected, drops: Drops, done: Completed, step: int) -> None:
        """A completed group: stale, filtered or ready."""
        g = done.group.group_id
        out.tally.add("completed", done.group)
        if self.ready.too_old(done.group, step):
            out.tally.add("stale", done.group)
            out.stale_ids.append(g)
            return drops.add("stale", [g], done.entry_ids, done.traj_ids, replace=1)
        reason = self.drop(done.group)
        if reason is not None and len(out.filtered_ids) < self.filter_cap:
            out.filtered[reason] += 1
            out.filtered_ids.append(g)
            return drops.add("filtered", [g], done.entry_ids, done.traj_ids, replace=1)
        out.overdue += self.ready.overdue(done.group, step)
        self.ready.add(Ready(done.group, done.entry_ids, done.traj_ids))
        return None

    def refuse(self, generators: set[str], backlog: Entries, out: Collected, drops: Drops) -> None:
        """Drop every group holding an entry of `generators` (quarantined), and their `backlog`
        entries: acknowledged, not finished, so their prompts are issued again."""

        def theirs(refs: list[str]) -> bool:
            return any(split_ref(r)[0] in generators for r in refs)

        for r in self.ready.remove(lambda r: theirs(r.entry_ids)):
            self._forget(r.traj_ids, r.group.group_id)
            drops.add("refused", r.traj_ids, r.entry_ids)
            out.refused += len(r.entry_ids)
        for c in self.assembler.remove(lambda refs, _: theirs(refs)):
            self._forget(c.traj_ids, c.group.group_id)
            drops.add("refused", c.traj_ids, c.entry_ids)
            out.refused += len(c.entry_ids)
        if backlog:
            drops.add("refused", [t.traj_id for _, t in backlog], [e for e, _ in backlog])
            out.refused += len(backlog)

    def _forget(self, traj_ids: list[str], group_id: str) -> None:
        """Forget ids of a refused group, so that its answers issued again are not duplicates."""
        self.ids.forget(traj_ids)
        self.assembler.completed.discard(group_id)

    def drop_aged(self, out: Collected, step: int) -> Drops:
        """Move the floor to `step`'s and drop, as stale, the groups kept from an earlier step
        that have grown too old meanwhile and the incomplete groups that fell below the floor."""
        self.ids.move_floor(step)
        drops = Drops()
        aged = self.ready.aged(step)
        stale: list[Ready | Completed] = [*aged, *self.assembler.forget_before(self.ids.floor)]
        for old in stale:
            out.tally.add("stale", old.group)
            out.stale_ids.append(old.group.group_id)
            drops.add("stale", [old.group.group_id], old.entry_ids, old.traj_ids, replace=1)
        return drops
