"""The Redis key layout of one run: every key lives under `rl:{run_id}:` (ARCHITECTURE.md).

`RunKeys` is the one place that spells the names, so the broker's classes, the ACL rules
(broker/acl.py) and `rollctl status` cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

GEN_GROUP = "gen"  # the prompts stream's consumer group: the generators
LEARNER_GROUP = "learner"  # the trajectories stream's consumer group: the learner ranks


def run_prefix(run_id: str) -> str:
    """`rl:{run_id}:`, the prefix of every key of the run."""
    return f"rl:{run_id}:"


@dataclass(frozen=True)
class RunKeys:
    """The names of one run's keys."""

    run_id: str

    @property
    def prefix(self) -> str:
        return run_prefix(self.run_id)

    @property
    def prompts(self) -> str:
        """Stream, group `gen`: one entry per unit of work."""
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        """Stream, group `learner`: one entry per finished group (or replicated sample)."""
        return self.prefix + "trajectories"

    @property
    def dlq(self) -> str:
        """Stream: rejected entries with their reason and original id."""
        return self.prefix + "dlq"

    @property
    def dlq_reasons(self) -> str:
        """Hash: reason code -> entries dead-lettered with it."""
        return self.prefix + "dlq_reasons"

    @property
    def weights(self) -> str:
        """Hash: the last published version, its path, sha256 and zmq endpoint."""
        return self.prefix + "weights"

    @property
    def run(self) -> str:
        """Hash: config fingerprint, schema version, state, counters."""
        return self.prefix + "run"

    def gen(self, generator_id: str) -> str:
        """Hash with a TTL: one generator's heartbeat, loaded version and counters."""
        return f"{self.prefix}gen:{generator_id}"

    @property
    def gen_pattern(self) -> str:
        """Matches every generator's heartbeat key (SCAN MATCH, ACL key patterns)."""
        return self.gen("*")

    def generator_id(self, gen_key: str) -> str:
        """The generator id in a key made by `gen`."""
        return gen_key.removeprefix(self.gen(""))
