"""`LearnerBroker`: what a learner rank does with Redis, and nothing a generator does.

Over one client it holds the run registry (broker/registry.py), the writing side of the prompts
stream and the reading side of the trajectories stream (broker/streams.py), and the auditor of
lost writes (broker/audit.py); each module's docstring states its guarantees. What this class adds
is the order between them:
- the run is created and checked before anything else: `ensure_groups`, `register_run`,
  `check_intact` (learner/loop.py);
- before adding prompts it re-adds any Redis forgot, so new entries never hide a lost tail;
- every read first runs the auditor's `watch` (at most once a second): a Redis that lost the
  run raises `RunLost`, and forgotten prompts, trajectory writes and weights are repaired or
  counted in `lost`.
"""

from __future__ import annotations

from collections import Counter

import redis

from rollflash.broker.audit import WATCH_INTERVAL_S, LossAuditor
from rollflash.broker.fingerprint import Fingerprint
from rollflash.broker.redis_io import RunRedis
from rollflash.broker.registry import RunRegistry
from rollflash.broker.schema import PromptWork, Trajectory
from rollflash.broker.streams import DeadLetters, PromptQueue, Rejected, TrajectoryStream
from rollflash.broker.wire import WireLimits


class LearnerBroker:
    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        max_payload_bytes: int,
        busy_timeout_s: float = 60.0,
        watch_interval_s: float = WATCH_INTERVAL_S,
        limits: WireLimits | None = None,
    ):
        io = RunRedis(client, run_id, busy_timeout_s)
        self.keys = io.keys
        self._dead_letters = DeadLetters(io, max_payload_bytes)
        self._registry = RunRegistry(io)
        self._prompts = PromptQueue(io, max_payload_bytes, self._dead_letters)
        limits = limits or WireLimits(max_bytes=max_payload_bytes)
        self._trajectories = TrajectoryStream(io, limits, self._dead_letters)
        self._auditor = LossAuditor(io, self._registry, self._prompts, watch_interval_s)

    @property
    def lost(self) -> Counter[str]:
        """Acknowledged writes Redis forgot: prompts, trajectory_writes, weights."""
        return self._auditor.lost

    @property
    def dead_lettered(self) -> int:
        """Trajectory entries this process rejected to the dlq."""
        return self._dead_letters.count

    # --- the run --------------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        self._registry.ensure_groups()

    def register_run(self, fingerprint: Fingerprint) -> None:
        self._registry.register(fingerprint)

    def check_intact(self) -> None:
        self._registry.check_intact()

    def run_fields(self) -> dict[str, str]:
        return self._registry.fields()

    def set_run_fields(self, **fields: str | int | float) -> None:
        self._registry.set_fields(**fields)

    def count_in_run(self, name: str, n: int) -> None:
        self._registry.count(name, n)

    # --- prompts --------------------------------------------------------------------------------
    def add_prompts(self, works: list[PromptWork], issued: int | None = None) -> None:
        """XADD the prompts, and the new `issued` total to the run hash in the same transaction."""
        self._auditor.verify_prompts()  # before our XADDs move the stream's last id past a lost tail
        self._auditor.added_prompts(self._prompts.add(works, issued), issued)

    def replaced_groups(self) -> int:
        return self._prompts.replaced_groups()

    # --- trajectories -----------------------------------------------------------------------------
    def read_trajectories(
        self,
        consumer: str,
        count: int,
        block_ms: int,
        vocab_size: int,
        own_pending: bool = False,
        after: str = "0",
    ) -> tuple[list[tuple[str, Trajectory]], list[Rejected]]:
        self._auditor.watch()
        return self._trajectories.read(consumer, count, block_ms, vocab_size, own_pending, after)

    def ack_trajectories(self, entry_ids: list[str], replaced: int = 0) -> None:
        self._trajectories.ack(entry_ids, replaced)

    # --- weights --------------------------------------------------------------------------------
    def announce_weights(
        self, version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
    ) -> None:
        self._registry.announce_weights(version, path, sha256, zmq_endpoint, http_url)

    def remember_announced(
        self, version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
    ) -> None:
        self._registry.remember_announced(version, path, sha256, zmq_endpoint, http_url)

    def loaded_versions(self) -> set[int]:
        return self._registry.loaded_versions()

    def generator_idle_frac(self) -> float | None:
        """Mean over live generators of their idle share since they started (None if none)."""
        return self.generator_stats()[0]

    def generator_reward_errors(self) -> int:
        """Reward-function errors counted so far by the live generators (their heartbeats'
        `reward_errors`; a dead generator's count leaves with its expired heartbeat)."""
        return self.generator_stats()[1]

    def generator_stats(self) -> tuple[float | None, int]:
        """(`generator_idle_frac`, `generator_reward_errors`) from one read of the heartbeats."""
        live = self._registry.live_generators().values()
        shares = [float(g["idle_frac"]) for g in live if g.get("idle_frac") not in (None, "")]
        errors = sum(int(g["reward_errors"]) for g in live if g.get("reward_errors", "").isdigit())
        return (sum(shares) / len(shares) if shares else None), errors

    def generator_reloads(self) -> dict[str, float]:
        """`gen/reload_fetch_s` and `gen/reload_pause_s`: the longest over the live generators of
        their last version's fetch and swap (generators/reload.py); empty before any reload."""
        reloaded = [
            g for g in self._registry.live_generators().values() if g.get("reloads", "0") != "0"
        ]
        out = {}
        for key in ("reload_fetch_s", "reload_pause_s"):
            values = [float(g[key]) for g in reloaded if g.get(key)]
            if values:
                out[f"gen/{key}"] = max(values)
        return out

    # --- lost writes (also run by every read, through `watch`) ----------------------------------
    def track_trajectory_writes(self) -> None:
        """Rank 0 only: one witness of forgotten trajectory writes per run."""
        self._auditor.track_trajectory_writes()

    def verify_prompts(self) -> int:
        return self._auditor.verify_prompts()

    def verify_trajectories(self) -> int:
        return self._auditor.verify_trajectories()

    def verify_weights(self) -> bool:
        return self._auditor.verify_weights()
