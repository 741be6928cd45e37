"""The Redis key layout of one run: every key lives under `rl:{run_id}:` (ARCHITECTURE.md).

`RunKeys` is the one place that spells the names, so the broker's classes, the ACL rules
(broker/connect/acl.py) and `rollctl status` cannot drift apart.

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
from typing import overload

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


class Key:
    """A run-wide key, named as the attribute it is assigned to: `RunKeys(run_id).prompts` is
    `rl:{run_id}:prompts`. `doc` says what the key holds (its type, who writes it)."""

    def __init__(self, doc: str):
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, keys: None, owner: type) -> Key: ...
    @overload
    def __get__(self, keys: RunKeys, owner: type) -> str: ...
    def __get__(self, keys: RunKeys | None, owner: type) -> Key | str:
        return self if keys is None else keys.prefix + self.name


@dataclass(frozen=True)
class RunKeys:
    """The names of one run's keys."""

    run_id: str

    @property
    def prefix(self) -> str:
        return run_prefix(self.run_id)

    prompts = Key(
        "Stream, group `gen`: one entry per unit of work (the learner adds, generators claim)."
    )
    dlq = Key("Stream: trajectory entries the learner rejected, with their reason and original id.")
    dlq_reasons = Key("Hash: reason code -> entries the learner dead-lettered with it.")
    weights = Key("Hash: the last published version, its path, sha256 and zmq endpoint.")
    run = Key("Hash: config fingerprint, schema version, state, counters.")
    lease = Key("Hash with a TTL: the learner holding the run (token, host, pid, since).")
    mac_key = Key(
        "String: the key of the MAC on prompt entries (the learner's user alone reads it)."
    )
    inflight = Key("Hash: traj_id -> prompt entry id, for every issued prompt not yet finished.")
    generators = Key(
        "Hash: generator id -> `active` or `quarantined ...`; `{id}:trimmed` -> entries the "
        "learner trimmed from its stream."
    )
    joined = Key(
        "Set: ids of generators asking to join (each adds its own; the learner admits them)."
    )

    def trajectories(self, generator_id: str) -> str:
        """Stream, group `learner`: one generator's finished groups (or replicated samples)."""
        return f"{self.prefix}traj:{generator_id}"

    def generator_dlq(self, generator_id: str) -> str:
        """Stream: prompt entries one generator rejected, with their reason."""
        return f"{self.prefix}dlq:{generator_id}"

    def gen(self, generator_id: str) -> str:
        """Hash with a TTL: one generator's heartbeat, loaded version and counters."""
        return f"{self.prefix}gen:{generator_id}"

    def generator_of(self, stream: str) -> str:
        """The generator id in a key made by `trajectories`."""
        return stream.removeprefix(self.trajectories(""))
