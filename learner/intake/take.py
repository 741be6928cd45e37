"""Taking a step's groups (learner/intake/collect.py). Once the ranks hold B ready groups together, each
rank takes a quota of its own (learner/process/dist.py `split_quotas`: first the groups that could not
wait for the next step), oldest first (learner/intake/ready.py), and keeps the rest, unacknowledged, for
the next step.

A group another rank trains in the same step (a duplicate that reached two ranks) is dropped by
the higher rank; every rank remembers every trained id, so none is trained twice later. The
taken groups' traj_ids leave `inflight`; their entries stay pending until the checkpoint."""

from __future__ import annotations

from rollflash.learner.intake.collected import Collected
from rollflash.learner.intake.drops import Drops
from rollflash.learner.intake.lineage import Lineage
from rollflash.learner.intake.ready import ReadyGroups
from rollflash.learner.intake.recent import ConsumedIds
from rollflash.learner.process.dist import Dist, split_quotas


class Taker:
    def __init__(self, ready: ReadyGroups, ids: ConsumedIds, dist: Dist, lineage: Lineage):
        self.ready, self.ids, self.dist, self.lineage = ready, ids, dist, lineage

    def quota(self, held: list[int], due: list[int], want: int) -> int:
        """This rank's share of `want` groups, from every rank's ready and due groups."""
        return split_quotas(held, want, first=due)[self.dist.rank]

    def take(self, quota: int, step: int, out: Collected) -> Drops:
        """Move this rank's `quota` of ready groups into `out`, oldest first; returns the
        duplicates dropped and the taken traj_ids leaving `inflight` (collective)."""
        mine = self.ready.take(quota)
        step_of = self.lineage.step_of
        taken = self.dist.gather([(r.group.traj_id, step_of(r.group.issued_version)) for r in mine])
        earlier = {t for ids in taken[: self.dist.rank] for t, _ in ids}
        drops = Drops()
        for r in mine:
            if r.group.traj_id in earlier:
                out.duplicate_ids.append(r.group.traj_id)
                drops.add("duplicate", [r.group.traj_id], r.entry_ids)
                continue
            out.groups.append(r.group)
            out.tally.add("trained", r.group)
            out.entry_ids.extend(r.entry_ids)
            out.part_ids.extend(r.traj_ids)
            out.staleness[max(0, self.ready.age(r.group, step))] += 1
        self.ids.trained.update((t, s) for ids in taken for t, s in ids)
        # a copy of a group another rank has just trained
        for r in self.ready.remove(lambda r: r.group.traj_id in self.ids.trained):
            out.duplicate_ids.append(r.group.traj_id)
            drops.add("duplicate", [r.group.traj_id], r.entry_ids)
        drops.finished += out.part_ids  # trained: done with their prompts
        return drops
