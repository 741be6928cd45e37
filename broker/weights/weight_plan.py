"""Who a generator fetches a weight version from (`weights.transport: http`).

The learner's server answers each generator's request for a version's source (broker/
weight_server.py) from this plan, so that the learner sends about one copy of a version however
many generators fetch it (the fan-out of INTELLECT-2's SHARDCAST and of relay workers):
- every generator that asks, and offers a relay, becomes a holder of that version from then on
  (a relay serves a chunk as soon as it has verified it, so a holder that has only begun its own
  fetch is already a source);
- a generator is sent to the earliest live holder, among those that asked before it, that
  serves fewer than `fanout` generators; only when none has room is it sent to the learner. So
  the holders fill a breadth-first fan-out tree rooted at the learner (depth about
  log_fanout(N) for N generators), and a generator never fetches from one that fetches from it;
- a generator whose source failed names it (`failed`): that holder is dropped for the version,
  and the generator is sent elsewhere by the same rule, the learner if no earlier holder is left.
Each form of a version (its full file, or its delta: broker/weights/manifest.py) has a tree of its own,
since a relay holds only the form it fetched.
Memory is bounded whatever is asked: only the newest `keep` versions are remembered, and at most
`max_holders` holders of each (a generator that asks once they are all taken is sent by the same
rule, and serves nobody). The learner's server plans only versions it holds, and only for the
generator that asks, proven by its own credentials (broker/weights/weight_auth.py). A holder cannot hand
out bytes that are not the version's: every generator checks every chunk against the manifest
the learner announced.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Holder:
    generator: str
    url: str | None  # None: it fetches, but serves nobody (weights.relay false)
    load: int = 0  # generators sent to it
    alive: bool = True


@dataclass
class _Version:
    holders: list[_Holder] = field(default_factory=list)  # in the order they asked
    place: dict[str, int] = field(default_factory=dict)  # generator -> its index in holders
    # no holder before this index can take another generator: holders only fill up or fail,
    # so it only moves forward, and finding the earliest holder with room costs O(1) amortised
    first_open: int = 0
    learner_load: int = 0


MAX_HOLDERS = 4096  # holders remembered per version: above any real run's generators


class SourcePlanner:
    def __init__(
        self, learner_url: str, fanout: int, keep: int = 8, max_holders: int = MAX_HOLDERS
    ):
        self.learner_url, self.fanout, self.keep = learner_url, fanout, keep
        self.max_holders = max_holders
        self._versions: dict[tuple[int, str], _Version] = {}

    def assign(
        self,
        version: int,
        generator: str,
        relay_url: str | None,
        failed: list[str],
        form: str = "full",
    ) -> str:
        """The URL `generator` fetches `form` of `version` from (the learner's own or a
        relay's)."""
        plan = self._plan(version, form)
        if failed:
            gone = set(failed)
            for h in plan.holders:
                if h.url in gone:
                    h.alive = False
        me = plan.place.get(generator)
        if me is None:
            me = len(plan.holders)
            if me < self.max_holders:
                plan.place[generator] = me
                plan.holders.append(_Holder(generator, relay_url))
        holders = plan.holders
        while plan.first_open < len(holders) and not self._has_room(holders[plan.first_open]):
            plan.first_open += 1
        if plan.first_open >= me:  # no earlier holder with room
            plan.learner_load += 1
            return self.learner_url
        chosen = holders[plan.first_open]
        chosen.load += 1
        assert chosen.url is not None
        return chosen.url

    def _has_room(self, h: _Holder) -> bool:
        return h.alive and h.url is not None and h.load < self.fanout

    def holders(self) -> int:
        """Holders remembered, over every version and form (at most `keep` x forms x
        `max_holders`)."""
        return sum(len(plan.holders) for plan in self._versions.values())

    def learner_load(self, version: int, form: str = "full") -> int:
        """How many times the learner itself was named as the source of `form` of `version`."""
        plan = self._versions.get((version, form))
        return plan.learner_load if plan is not None else 0

    def _plan(self, version: int, form: str) -> _Version:
        key = (version, form)
        if key not in self._versions:
            self._versions[key] = _Version()
            newest = sorted({v for v, _ in self._versions})[-self.keep :]
            for old in [k for k in self._versions if k[0] not in newest]:
                del self._versions[old]
        return self._versions[key]
