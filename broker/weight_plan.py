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
Only the newest `keep` versions are remembered. A holder cannot hand out bytes that are not the
version's: every generator checks every chunk against the manifest the learner announced.
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
    learner_load: int = 0


class SourcePlanner:
    def __init__(self, learner_url: str, fanout: int, keep: int = 8):
        self.learner_url, self.fanout, self.keep = learner_url, fanout, keep
        self._versions: dict[int, _Version] = {}

    def assign(self, version: int, generator: str, relay_url: str | None, failed: list[str]) -> str:
        """The URL `generator` fetches `version` from (the learner's own or a relay's)."""
        plan = self._plan(version)
        for h in plan.holders:
            if h.url in failed:
                h.alive = False
        me = next((i for i, h in enumerate(plan.holders) if h.generator == generator), None)
        if me is None:
            me = len(plan.holders)
            plan.holders.append(_Holder(generator, relay_url))
        earlier = [
            h for h in plan.holders[:me] if h.alive and h.url is not None and h.load < self.fanout
        ]
        if not earlier:
            plan.learner_load += 1
            return self.learner_url
        chosen = earlier[0]
        chosen.load += 1
        assert chosen.url is not None
        return chosen.url

    def learner_load(self, version: int) -> int:
        """How many times the learner itself was named as the source of `version`."""
        plan = self._versions.get(version)
        return plan.learner_load if plan is not None else 0

    def _plan(self, version: int) -> _Version:
        if version not in self._versions:
            self._versions[version] = _Version()
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]
        return self._versions[version]
