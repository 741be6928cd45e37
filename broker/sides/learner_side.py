"""`LearnerBroker`: what a learner rank does with Redis, and nothing a generator does.

Over one client it holds the run's lease (broker/channels/lease.py), the run registry
(broker/channels/registry.py), the writing side of the prompts stream (broker/channels/streams.py),
the reading side of every generator's stream (broker/channels/trajectories.py), the generators'
roster (broker/channels/roster.py), retention (broker/channels/retention.py), the lost-prompt check
(broker/channels/inflight.py) and the auditor of lost writes (broker/channels/audit.py); each
module's docstring states its guarantees. What this class adds is the order between them:
- the lease comes first: rank 0 takes it (`take_lease`) before anything is written, the other
  ranks and the publishing process use its token (`use_lease`); every write below is fenced;
- then the run is created and checked: `ensure_groups`, `register_run`, `check_intact`;
- before adding prompts it re-adds any Redis forgot, so new entries never hide a lost tail;
- every read first runs `maintain` (at most once a second): the auditor's `watch` (a Redis that
  lost the run raises `RunLost`; forgotten prompts, trajectory writes and weights are repaired or
  counted in `lost`) and, on rank 0, the admission of joined generators, the check and trim of
  their streams (quarantining a misbehaving one) and, every few seconds, retention;
- a rejected entry is dead-lettered only after the caller recorded it (`dead_letter`), and one
  whose provenance was forged quarantines its generator.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis

from rollflash.broker.channels import retention
from rollflash.broker.channels.audit import WATCH_INTERVAL_S, LossAuditor
from rollflash.broker.channels.inflight import LostPrompts
from rollflash.broker.channels.lease import RunLease
from rollflash.broker.channels.provenance import FORGED, sign
from rollflash.broker.channels.registry import RunRegistry
from rollflash.broker.channels.retention import Retention
from rollflash.broker.channels.roster import ACTIVE, Roster, statuses
from rollflash.broker.channels.serving import ServingCheck
from rollflash.broker.channels.streams import DeadLetters, PromptQueue, Rejected
from rollflash.broker.channels.trajectories import Good, TrajectoryReader, split_ref
from rollflash.broker.config.fingerprint import Fingerprint
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.redis_io import RunRedis
from rollflash.broker.wire.schema import PromptWork
from rollflash.broker.wire.wire import WireLimits

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config

QUARANTINE = FORGED | {"trimmed"}  # rejections an honest generator never causes


class LearnerBroker:
    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        max_payload_bytes: int,
        busy_timeout_s: float = 60.0,
        watch_interval_s: float = WATCH_INTERVAL_S,
        limits: WireLimits | None = None,
        lease_ttl_s: float = 30.0,
        max_unacked: int = 100_000,
        dlq_retention: tuple[int, float] = (1000, 7 * 86400.0),
        keep_acknowledged_s: float = 0.0,
    ):
        io = RunRedis(client, run_id, busy_timeout_s)
        self.io, self.keys = io, io.keys
        self.lease = RunLease(io, lease_ttl_s)
        self._registry = RunRegistry(io, self.lease)
        self._prompts = PromptQueue(io, max_payload_bytes, self.lease)
        self._dead_letters = DeadLetters(io, self.lease)
        self.limits = limits or WireLimits(max_bytes=max_payload_bytes)
        self._reader: TrajectoryReader | None = None  # once registered (it needs the MAC key)
        self.roster = Roster(io, self.lease, max_unacked, keep_acknowledged_s)
        self._retention = Retention(io, self.lease, *dlq_retention)
        self._auditor = LossAuditor(
            io, self._registry, self._prompts, self.roster, watch_interval_s
        )
        self.lost_prompts = LostPrompts(io, self.lease, self.roster)
        self.serving: ServingCheck | None = None  # set by rank 0's publisher (weights.probe)
        self._mac_key = b""
        self._maintainer = False  # rank 0: admits, checks and trims (`track_trajectory_writes`)
        self._generators: list[str] = []  # the active ones, as of the last `maintain`
        self._refused: set[str] = set()  # the quarantined ones, as of the last `maintain`
        self._next_trim = 0.0

    @classmethod
    def for_config(cls, cfg: Config) -> LearnerBroker:
        """A broker for the run with the config's limits (no lease yet); `redis.url` is set by
        then (`rollctl run` fills it with its own server's)."""
        redis_cfg, trainer = (
            cfg.redis,
            cfg.trainer,
        )  # an honest stream holds, unacknowledged, what admission
        # lets be in flight and what was trained since the last checkpoint (acked once durable)
        replicas = cfg.rollout.num_return_sequences + cfg.rollout.redundant_samples
        steps = math.ceil(1 + trainer.async_ratio) + trainer.checkpoint_every
        per_prompt = replicas if cfg.rollout.replicate_prompts else 1
        in_flight = steps * trainer.rollout_batch_size * per_prompt
        return cls(
            connect(redis_cfg.url or "", redis_cfg.connect_timeout_s, redis_cfg.sentinel),
            cfg.run.run_id,
            redis_cfg.max_payload_bytes,
            limits=WireLimits.for_config(cfg, vocab_size=None),
            lease_ttl_s=redis_cfg.lease_ttl_s,
            max_unacked=4 * in_flight + 256,  # more from one generator: it floods (roster.py)
            dlq_retention=(redis_cfg.dlq_max_entries, redis_cfg.dlq_max_age_s),
            keep_acknowledged_s=redis_cfg.keep_acknowledged_s,
        )

    @property
    def lost(self) -> Counter[str]:
        """Acknowledged writes Redis forgot: prompts, trajectory_writes, weights."""
        return self._auditor.lost

    # --- the lease ------------------------------------------------------------------------------
    def take_lease(self, take_over: bool = False) -> str:
        """Rank 0, before any write: take the run's lease (`LeaseHeld` names its holder) and
        keep it renewed; returns the token for the other ranks."""
        self.lease.take(take_over)
        self.lease.keep()
        assert self.lease.token is not None
        return self.lease.token

    def use_lease(self, token: str) -> None:
        """Fence this process's writes with rank 0's lease."""
        self.lease.token = token

    def check_lease(self) -> None:
        """Before a file becomes visible (checkpoint, weights, ledger line): `LeaseLost` unless
        the lease is ours for at least its TTL."""
        self.lease.check()

    def release(self) -> None:
        self.lease.release()

    # --- the run --------------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        self._registry.ensure_groups()

    def register_run(self, fingerprint: Fingerprint) -> None:
        self._mac_key = self._registry.register(fingerprint)
        self._reader = TrajectoryReader(self.io, self.lease, self.limits, self._mac_key)

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
        """Sign and XADD the prompts, with the new `issued` total in the same call."""
        self._auditor.verify_prompts()  # before our XADDs move the stream's last id past a lost tail
        works = [sign(self._mac_key, w) for w in works]
        self._auditor.added_prompts(self._prompts.add(works, issued), issued)

    def replaced_groups(self) -> int:
        return self._prompts.replaced_groups()

    # --- generators -------------------------------------------------------------------------------
    def generators(self) -> list[str]:
        """The active generators, whose streams every read covers."""
        return list(self._generators)

    def maintain(self) -> None:
        """The work of a watch (module docstring), at most every watch interval."""
        if not self._auditor.due():
            return
        if self._maintainer:
            self.roster.admit_joined()
        self._auditor.watch()
        if self._maintainer:
            self.roster.check_streams(self._auditor.witnesses())
            every = statuses(self.io)
            self.roster.sweep([g for g, s in every.items() if s != ACTIVE])
            self.roster.contain([g for g, s in every.items() if s != ACTIVE])
            if self.serving is not None:  # the generators' proofs of what they serve
                self.serving.check()
            if time.monotonic() >= self._next_trim:
                self._next_trim = time.monotonic() + retention.INTERVAL_S
                self._retention.trim(sorted(every))
                self.roster.retire_idle()
        every = statuses(self.io)
        self._generators = sorted(g for g, s in every.items() if s == ACTIVE)
        self._refused = {g for g, s in every.items() if s != ACTIVE}

    def maintain_now(self) -> None:
        """`maintain`, retention included, whether or not they are due (tests, and a caller
        that just changed the roster)."""
        self._auditor.defer_watch(0.0)
        self._next_trim = 0.0
        self.maintain()

    def refused(self) -> set[str]:
        """Generators whose entries are refused (quarantined), as of the last `maintain`."""
        return set(self._refused)

    # --- trajectories -----------------------------------------------------------------------------
    def read_trajectories(
        self,
        consumer: str,
        count: int,
        block_ms: int | None,
        check: tuple[int, int, int],
        after: dict[str, str] | None = None,
    ) -> tuple[Good, list[Rejected]]:
        """Read every active generator's stream; `check` = (vocab size, group size, the
        learner's version) for validation; `after` re-reads this consumer's pending entries."""
        self.maintain()
        assert self._reader is not None, "register the run first"
        if not self._generators:
            if block_ms:
                time.sleep(block_ms / 1000)  # nobody to wait for yet
            return [], []
        return self._reader.read(consumer, self._generators, count, block_ms, check, after)

    def dead_letter(self, rejected: list[Rejected]) -> None:
        """Copy rejected entries (recorded by the caller) to the dlq and acknowledge them; a
        forged one quarantines its generator."""
        assert self._reader is not None, "register the run first"
        self._dead_letters.send(rejected, self._reader.acks([r.ref for r in rejected]))
        for r in rejected:
            if r.error.code in QUARANTINE:
                gid = split_ref(r.ref)[0]
                if self.roster.quarantine(gid, f"{r.error.code}: {r.reason}"):
                    self._generators = [g for g in self._generators if g != gid]
                    self._refused.add(gid)

    def ack_trajectories(
        self, refs: Sequence[str], finished: Sequence[str] = (), replaced: int = 0
    ) -> None:
        """Acknowledge entries; `finished`: traj_ids the learner is done with (trained, or
        dropped and replaced), forgotten by `inflight`; `replaced`: groups to replace. Safe to
        replay (broker/channels/trajectories.py `ack`)."""
        if refs or finished or replaced:
            assert self._reader is not None, "register the run first"
            self._reader.ack(refs, finished, replaced)

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

    def generator_stats(self) -> tuple[float | None, int]:
        """(`gen/idle_frac`, `reward/errors`) from one read of the heartbeats: the mean over live
        generators of their idle share since they started (None if none), and the reward-function
        errors they have counted so far (a dead generator's count leaves with its expired
        heartbeat)."""
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

    # --- lost writes (also run by every read, through `maintain`) -------------------------------
    def track_trajectory_writes(self) -> None:
        """Rank 0 only: one witness of forgotten trajectory writes per run, and the one
        process that admits, checks and trims generators' streams."""
        self._auditor.track_trajectory_writes()
        self._maintainer = True

    def verify_prompts(self) -> int:
        return self._auditor.verify_prompts()

    def verify_trajectories(self) -> int:
        return self._auditor.verify_trajectories()

    def verify_weights(self) -> bool:
        return self._auditor.verify_weights()
