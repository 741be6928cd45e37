"""The Redis side of a run: streams, consumer groups and the small hashes under `rl:{run_id}:`.

Delivery guarantees:
- A prompt entry is acknowledged by a generator in the same MULTI/EXEC transaction that adds its
  trajectory, so a group is never both lost and acknowledged. A generator that dies before that
  leaves the prompt pending; on restart it re-reads its own pending entries first, and any other
  generator takes it over (XAUTOCLAIM) once it has been idle for `rollout.reclaim_idle_s`.
- A trajectory entry is acknowledged by the learner only after the update that used it has been
  published (or after it was rejected), so a learner crash re-delivers it to the same consumer.
- Entries that fail to decode or validate are copied to `dlq` with the reason and their original
  id, then acknowledged: nothing is dropped silently and nothing poisons a reader twice.
Trajectories are at-least-once; the learner drops duplicates by `traj_id`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from broker.schema import (SCHEMA_VERSION, PromptWork, Trajectory, WireError, decode_prompt,
                           decode_trajectory, encode_prompt, encode_trajectory)

log = logging.getLogger(__name__)

GEN_GROUP = "gen"
LEARNER_GROUP = "learner"


class RunMismatch(RuntimeError):
    """This process was started with a config or schema that differs from the run's."""


@dataclass
class Rejected:
    entry_id: str
    reason: str


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class RunBroker:
    def __init__(self, client: redis.Redis, run_id: str, max_payload_bytes: int):
        self.r = client
        self.prefix = f"rl:{run_id}:"
        self.max_payload_bytes = max_payload_bytes
        self.prompts = self.prefix + "prompts"
        self.trajectories = self.prefix + "trajectories"
        self.dlq = self.prefix + "dlq"
        self.weights_key = self.prefix + "weights"
        self.run_key = self.prefix + "run"

    # --- set-up -------------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        for stream, group in ((self.prompts, GEN_GROUP), (self.trajectories, LEARNER_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def register_run(self, fingerprint: str) -> None:
        """Learner: record the run's config fingerprint, or refuse a run with another one."""
        self.r.hsetnx(self.run_key, "fingerprint", fingerprint)
        self.r.hsetnx(self.run_key, "schema", SCHEMA_VERSION)
        self._check_run(fingerprint)

    def join_run(self, fingerprint: str, timeout_s: float) -> None:
        """Generator: wait (read-only) for the learner to register the run, then check it."""
        deadline = time.monotonic() + timeout_s
        while self.r.hget(self.run_key, "fingerprint") is None:
            if time.monotonic() > deadline:
                raise RunMismatch(f"run {self.prefix} was not started by a learner within "
                                  f"{timeout_s:.0f}s: start the learner (rollctl start-learner)")
            time.sleep(0.2)
        self._check_run(fingerprint)

    def _check_run(self, fingerprint: str) -> None:
        have = self.r.hmget(self.run_key, ["fingerprint", "schema"])
        if _text(have[1]) != str(SCHEMA_VERSION):
            raise RunMismatch(f"run {self.prefix} uses wire schema {_text(have[1])}, "
                              f"this process speaks {SCHEMA_VERSION}")
        if _text(have[0]) != fingerprint:
            raise RunMismatch(f"run {self.prefix} was started with config fingerprint "
                              f"{_text(have[0])}, this process has {fingerprint}: use the same "
                              "config file, or another run.run_id")

    def set_run_fields(self, **fields: str | int | float) -> None:
        self.r.hset(self.run_key, mapping=fields)

    def run_fields(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in self.r.hgetall(self.run_key).items()}

    # --- prompts --------------------------------------------------------------------------------
    def add_prompts(self, works: list[PromptWork]) -> None:
        pipe = self.r.pipeline(transaction=True)
        for w in works:
            pipe.xadd(self.prompts, encode_prompt(w))
        pipe.execute()

    def claim_prompts(self, consumer: str, count: int, block_ms: int,
                      own_pending: bool = False) -> list[tuple[str, PromptWork]]:
        """Read up to `count` prompts for `consumer`; `own_pending` re-reads unacked ones first."""
        start = "0" if own_pending else ">"
        reply = self.r.xreadgroup(GEN_GROUP, consumer, {self.prompts: start}, count=count,
                                  block=None if own_pending else block_ms)
        return self._decode_prompts(reply[0][1] if reply else [])

    def _decode_prompts(self, entries: list) -> list[tuple[str, PromptWork]]:
        out = []
        for entry_id, fields in entries:
            entry_id = _text(entry_id)
            if not fields:  # pending entry deleted meanwhile
                self.r.xack(self.prompts, GEN_GROUP, entry_id)
                continue
            try:
                out.append((entry_id, decode_prompt(fields, self.max_payload_bytes)))
            except WireError as e:
                self.dead_letter(self.prompts, GEN_GROUP, entry_id, str(e), fields)
        return out

    def reclaim_prompts(self, consumer: str, min_idle_ms: int,
                        count: int) -> list[tuple[str, PromptWork]]:
        """Take over prompts another generator claimed but has not finished for `min_idle_ms`
        (it probably died): XAUTOCLAIM moves them to `consumer`."""
        _, entries, _ = self.r.xautoclaim(self.prompts, GEN_GROUP, consumer, min_idle_ms,
                                          start_id="0-0", count=count)
        return self._decode_prompts(entries)

    # --- trajectories -----------------------------------------------------------------------------
    def add_trajectory(self, t: Trajectory, prompt_entry_id: str | None) -> str:
        """XADD the trajectory and XACK its prompt atomically; returns the trajectory entry id."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.trajectories, encode_trajectory(t))
        if prompt_entry_id is not None:
            pipe.xack(self.prompts, GEN_GROUP, prompt_entry_id)
        return _text(pipe.execute()[0])

    def read_trajectories(self, consumer: str, count: int, block_ms: int, vocab_size: int,
                          own_pending: bool = False
                          ) -> tuple[list[tuple[str, Trajectory]], list[Rejected]]:
        """Read and validate; invalid entries are dead-lettered, acked, and returned as Rejected."""
        start = "0" if own_pending else ">"
        reply = self.r.xreadgroup(LEARNER_GROUP, consumer, {self.trajectories: start},
                                  count=count, block=None if own_pending else block_ms)
        good, bad = [], []
        for entry_id, fields in (reply[0][1] if reply else []):
            entry_id = _text(entry_id)
            try:
                good.append((entry_id, decode_trajectory(fields or {}, self.max_payload_bytes,
                                                         vocab_size)))
            except WireError as e:
                self.dead_letter(self.trajectories, LEARNER_GROUP, entry_id, str(e), fields or {})
                bad.append(Rejected(entry_id, str(e)))
        return good, bad

    def ack_trajectories(self, entry_ids: list[str]) -> None:
        if entry_ids:
            self.r.xack(self.trajectories, LEARNER_GROUP, *entry_ids)

    def dead_letter(self, stream: str, group: str, entry_id: str, reason: str,
                    fields: dict) -> None:
        """Copy a rejected entry to the dlq with its reason, then acknowledge the original."""
        log.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
        entry = {"reason": reason, "source": stream, "original_id": entry_id}
        for k, v in fields.items():
            entry[f"orig_{_text(k)}"] = v if len(v) <= self.max_payload_bytes else b"<oversize>"
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.dlq, entry, maxlen=100_000, approximate=True)
        pipe.xack(stream, group, entry_id)
        pipe.execute()

    # --- weights and liveness ---------------------------------------------------------------------
    def announce_weights(self, version: int, path: str, sha256: str, zmq_endpoint: str) -> None:
        self.r.hset(self.weights_key, mapping={
            "version": version, "path": path, "sha256": sha256, "published_at": time.time(),
            "zmq_endpoint": zmq_endpoint})

    def weights(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in self.r.hgetall(self.weights_key).items()}

    def heartbeat(self, generator_id: str, fields: dict, ttl_s: float) -> None:
        key = f"{self.prefix}gen:{generator_id}"
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={**fields, "heartbeat_at": time.time()})
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def live_generators(self) -> dict[str, dict[str, str]]:
        out = {}
        for key in self.r.scan_iter(match=f"{self.prefix}gen:*", count=100):
            fields = {_text(k): _text(v) for k, v in self.r.hgetall(key).items()}
            if fields:
                out[_text(key)[len(self.prefix) + 4:]] = fields
        return out

    def loaded_versions(self) -> set[int]:
        """Versions live generators report as loaded; retention must keep these."""
        return {int(g["loaded_version"]) for g in self.live_generators().values()
                if g.get("loaded_version", "").lstrip("-").isdigit()}
