"""The run registry: the `run` hash (config fingerprint, wire schema, state, counters), the
`weights` hash (the last published version) and the generators' heartbeat hashes.

Guarantees:
- Only the learner creates a run: `ensure_groups` and `register` create the streams, their
  consumer groups and the run hash. A generator only `join`s, read-only (its ACL allows no more),
  and refuses a run with another config fingerprint or wire schema (`RunMismatch`, naming each
  key that differs: broker/fingerprint.py).
- `check_intact` (learner) and `run_state` (generator, every turn) raise `RunLost` naming what is
  missing once Redis no longer holds the run; nothing here re-creates it.
- The `weights` hash is the source of truth for the published version; notifications
  (broker/notify.py) only make reloads prompt. The registry remembers what this process last
  announced, so that an announcement Redis forgot can be made again (broker/audit.py); an
  announcement and its repetition are serialised, so the hash never goes back to an older
  version when a background publisher (learner/publish.py) announces while the audit repeats.
- Heartbeat hashes expire after `ttl_s`: a generator that stops beating leaves
  `live_generators`, and weight retention keeps every version a live generator reports loaded.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from rollflash.broker.fingerprint import Fingerprint, fingerprint_mismatch
from rollflash.broker.keys import GEN_GROUP, LEARNER_GROUP
from rollflash.broker.redis_io import RunMismatch, RunRedis, opt_text, text, wire
from rollflash.broker.schema import SCHEMA_VERSION

Fields = dict[str, str | int | float]


class RunRegistry:
    def __init__(self, io: RunRedis):
        self.io, self.keys = io, io.keys
        self.fingerprint: str | None = None  # set by the learner's `register`
        self.announced: Fields | None = None  # the last weights this process announced
        self._announcing = threading.Lock()  # announce_weights and announce_again, one at a time

    # --- the run hash ---------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        """Learner: create both streams and their consumer groups unless they exist."""
        for stream, group in (
            (self.keys.prompts, GEN_GROUP),
            (self.keys.trajectories, LEARNER_GROUP),
        ):
            try:
                self.io.client.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def register(self, fingerprint: Fingerprint) -> None:
        """Learner: record the run's config fingerprint, or refuse a run with another one."""
        pipe = self.io.pipeline(transaction=True)
        pipe.hsetnx(self.keys.run, "fingerprint", fingerprint.digest)
        pipe.hsetnx(self.keys.run, "fingerprint_keys", fingerprint.to_json())
        pipe.hsetnx(self.keys.run, "schema", SCHEMA_VERSION)
        pipe.execute()
        self._check(fingerprint)
        self.fingerprint = fingerprint.digest

    def join(self, fingerprint: Fingerprint, timeout_s: float) -> None:
        """Generator: wait (read-only) for the learner to register the run, then check it."""
        deadline = time.monotonic() + timeout_s
        while self.io.hget(self.keys.run, "fingerprint") is None:
            if time.monotonic() > deadline:
                raise RunMismatch(
                    f"run {self.keys.prefix} was not started by a learner within "
                    f"{timeout_s:.0f}s: start the learner (rollctl start-learner)"
                )
            time.sleep(0.2)
        self._check(fingerprint)

    def _check(self, fingerprint: Fingerprint) -> None:
        reply: Any = self.io.client.hmget(self.keys.run, ["fingerprint", "schema"])
        have, schema = opt_text(reply[0]), opt_text(reply[1])
        if have is None:  # registered a moment ago (`join` saw it): Redis lost it since
            raise self.io.lost(f"the run hash {self.keys.run} is gone")
        if schema != str(SCHEMA_VERSION):
            raise RunMismatch(
                f"run {self.keys.prefix} uses wire schema {schema}, "
                f"this process speaks {SCHEMA_VERSION}"
            )
        if have != fingerprint.digest:
            raise self._fingerprint_mismatch(fingerprint)

    def _fingerprint_mismatch(self, fingerprint: Fingerprint) -> RunMismatch:
        """The refusal naming each shared key whose value differs from the run's."""
        recorded = self.io.hget(self.keys.run, "fingerprint_keys")
        return fingerprint_mismatch(self.keys.prefix, recorded, fingerprint)

    def check_intact(self) -> None:
        """Raise `RunLost` naming what is missing unless Redis still holds the run hash (with
        this run's fingerprint), both streams and both consumer groups. Needs XINFO (the learner's
        ACL user; not the generator's). One round trip."""
        pipe = self.io.pipeline(transaction=False)
        pipe.hget(self.keys.run, "fingerprint")
        pipe.xinfo_groups(self.keys.prompts)
        pipe.xinfo_groups(self.keys.trajectories)
        fingerprint, *groups = pipe.execute(raise_on_error=False)
        if fingerprint is None:
            raise self.io.lost(f"the run hash {self.keys.run} is gone")
        if self.fingerprint is not None and text(fingerprint) != self.fingerprint:
            raise RunMismatch(
                f"run {self.keys.prefix} now has config fingerprint {text(fingerprint)}, "
                f"this learner registered {self.fingerprint}"
            )
        for stream, group, info in zip(
            (self.keys.prompts, self.keys.trajectories), (GEN_GROUP, LEARNER_GROUP), groups
        ):
            info = self.io.stream_reply(info, stream)
            if group not in {text(g["name"]) for g in info}:
                raise self.io.lost(f"the consumer group {group!r} of {stream} is gone")

    def run_state(self) -> str | None:
        """The run's `state` field (None before training starts); raises `RunLost` when the run
        hash is gone. What a generator checks every turn (its ACL allows no XINFO)."""
        fields = self.fields()
        if "fingerprint" not in fields:
            raise self.io.lost(f"the run hash {self.keys.run} is gone")
        return fields.get("state")

    def fields(self) -> dict[str, str]:
        return self.io.hash(self.keys.run)

    def set_fields(self, **fields: str | int | float) -> None:
        self.io.write(lambda: self.io.client.hset(self.keys.run, mapping=wire(fields)))

    def count(self, name: str, n: int) -> None:
        """Add `n` to the run hash's counter `name` (learner only: generators may not write it)."""
        self.io.write(lambda: self.io.client.hincrby(self.keys.run, name, n))

    # --- weights ----------------------------------------------------------------------------------
    def announce_weights(
        self, version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
    ) -> None:
        """Learner rank 0: record a published version in the `weights` hash."""
        with self._announcing:
            self.announced = _announcement(version, path, sha256, zmq_endpoint, http_url)
            self._write_announced()

    def remember_announced(
        self, version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
    ) -> None:
        """Keep an announcement another process of this learner made (its publishing process,
        learner/publish_process.py), so that the audit makes it again if Redis forgets it."""
        with self._announcing:
            if self.announced is None or int(self.announced["version"]) < version:
                self.announced = _announcement(version, path, sha256, zmq_endpoint, http_url)

    def announce_again(self) -> None:
        """Write the last announcement again (Redis forgot it); nothing if there was none."""
        with self._announcing:
            self._write_announced()

    def _write_announced(self) -> None:
        announced = self.announced
        if announced is not None:
            self.io.write(lambda: self.io.client.hset(self.keys.weights, mapping=wire(announced)))

    def weights(self) -> dict[str, str]:
        return self.io.hash(self.keys.weights)

    # --- generators' liveness ---------------------------------------------------------------------
    def heartbeat(self, generator_id: str, fields: Fields, ttl_s: float) -> None:
        key = self.keys.gen(generator_id)

        def write() -> None:
            pipe = self.io.pipeline(transaction=True)
            pipe.hset(key, mapping=wire({**fields, "heartbeat_at": time.time()}))
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.execute()

        self.io.write(write)

    def live_generators(self) -> dict[str, dict[str, str]]:
        """Each live generator's status hash, read in one pipeline after the key scan."""
        keys = [text(k) for k in self.io.client.scan_iter(match=self.keys.gen_pattern, count=100)]
        if not keys:
            return {}
        pipe = self.io.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        out = {}
        for key, raw in zip(keys, pipe.execute()):
            if raw:  # expired between the scan and the read
                out[self.keys.generator_id(key)] = {text(k): text(v) for k, v in raw.items()}
        return out

    def loaded_versions(self) -> set[int]:
        """Versions live generators report as loaded; retention must keep these."""
        return {
            int(g["loaded_version"])
            for g in self.live_generators().values()
            if g.get("loaded_version", "").lstrip("-").isdigit()
        }

    # --- for `rollctl status` ---------------------------------------------------------------------
    def stream_status(self) -> dict[str, dict[str, Any]]:
        """Each stream's length and its consumer groups' consumers, pending and lag."""
        out = {}
        for name, key in (
            ("prompts", self.keys.prompts),
            ("trajectories", self.keys.trajectories),
            ("dlq", self.keys.dlq),
        ):
            length: Any = self.io.client.xlen(key)
            out[name] = {"length": length, "groups": self._groups(key)}
        return out

    def dead_letters_by_code(self) -> dict[str, int]:
        """Entries dead-lettered so far, by reason code (broker/wire.py)."""
        return {code: int(n) for code, n in self.io.hash(self.keys.dlq_reasons).items()}

    def _groups(self, stream: str) -> list[dict[str, Any]]:
        if not self.io.client.exists(stream):
            return []
        groups: Any = self.io.client.xinfo_groups(stream)
        return [
            {
                "group": text(g["name"]),
                "consumers": g["consumers"],
                "pending": g["pending"],
                "lag": g.get("lag"),
            }
            for g in groups
        ]


def _announcement(
    version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
) -> Fields:
    """The `weights` hash's fields for a published version (`http_url`: where the learner
    serves its store, `weights.transport: http`)."""
    fields: Fields = {
        "version": version,
        "path": path,
        "sha256": sha256,
        "published_at": time.time(),
        "zmq_endpoint": zmq_endpoint,
    }
    if http_url:
        fields["http_url"] = http_url
    return fields
