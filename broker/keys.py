"""The Redis key layout of one run: every key lives under `rl:{run_id}:` (ARCHITECTURE.md).

`RunKeys` is the one place that spells the names, so the broker's classes, the ACL rules
(broker/acl.py) and `rollctl status` cannot drift apart.

Keys a generator may write carry its id (`traj:{id}`, `dlq:{id}`, `gen:{id}`), so that one
generator's credentials reach only its own keys; the shared ones (`prompts`, `run`, `weights`,
`inflight`, `generators`, `lease`, `dlq`, `dlq_reasons`) are written by the learner alone, apart
from claiming and acknowledging prompts and adding a name to `joined`. Run ids and generator ids
are restricted to `[A-Za-z0-9_.-]{1,64}` (`valid_name`): they are put into ACL key patterns, where
`*`, `?` or `[` would widen a pattern to other runs' or generators' keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GEN_GROUP = "gen"  # the prompts stream's consumer group: the generators
LEARNER_GROUP = "learner"  # each generator's trajectories stream's group: the learner ranks

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAME_RULE = "1 to 64 of A-Z a-z 0-9 _ . -"


def valid_name(value: str) -> bool:
    """A run id or generator id that may go into key names and ACL key patterns."""
    return NAME.fullmatch(value) is not None


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
        """Stream, group `gen`: one entry per unit of work (the learner adds, generators claim)."""
        return self.prefix + "prompts"

    def trajectories(self, generator_id: str) -> str:
        """Stream, group `learner`: one generator's finished groups (or replicated samples)."""
        return f"{self.prefix}traj:{generator_id}"

    def generator_dlq(self, generator_id: str) -> str:
        """Stream: prompt entries one generator rejected, with their reason."""
        return f"{self.prefix}dlq:{generator_id}"

    @property
    def dlq(self) -> str:
        """Stream: trajectory entries the learner rejected, with their reason and original id."""
        return self.prefix + "dlq"

    @property
    def dlq_reasons(self) -> str:
        """Hash: reason code -> entries the learner dead-lettered with it."""
        return self.prefix + "dlq_reasons"

    @property
    def weights(self) -> str:
        """Hash: the last published version, its path, sha256 and zmq endpoint."""
        return self.prefix + "weights"

    @property
    def run(self) -> str:
        """Hash: config fingerprint, schema version, state, counters."""
        return self.prefix + "run"

    @property
    def lease(self) -> str:
        """Hash with a TTL: the learner holding the run (token, host, pid, since)."""
        return self.prefix + "lease"

    @property
    def mac_key(self) -> str:
        """String: the key of the MAC on prompt entries (the learner's user alone reads it)."""
        return self.prefix + "mac_key"

    @property
    def inflight(self) -> str:
        """Hash: traj_id -> prompt entry id, for every issued prompt not yet finished."""
        return self.prefix + "inflight"

    @property
    def generators(self) -> str:
        """Hash: generator id -> `active` or `quarantined ...`; `{id}:trimmed` -> entries the
        learner trimmed from its stream."""
        return self.prefix + "generators"

    @property
    def joined(self) -> str:
        """Set: ids of generators asking to join (each adds its own; the learner admits them)."""
        return self.prefix + "joined"

    def gen(self, generator_id: str) -> str:
        """Hash with a TTL: one generator's heartbeat, loaded version and counters."""
        return f"{self.prefix}gen:{generator_id}"

    def generator_of(self, stream: str) -> str:
        """The generator id in a key made by `trajectories`."""
        return stream.removeprefix(self.trajectories(""))
