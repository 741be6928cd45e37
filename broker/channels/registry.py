"""The run registry: the `run` hash (config fingerprint, wire schema, state, counters), the
`weights` hash (the last published version) and the generators' heartbeat hashes.

Guarantees:
- Only the learner creates a run: `ensure_groups` and `register` create the prompts stream, its
  consumer group, the learner's dlq, the run hash and the MAC key, under its lease (every write
  of the learner here is fenced: broker/channels/lease.py). A generator only `join`s, read-only (its ACL
  allows no more), and refuses a run with another config fingerprint or wire schema
  (`RunMismatch`, naming each key that differs: broker/config/fingerprint.py). The fingerprint is fixed
  by the first learner that trains (the run's `state` set); until then a learner replaces the
  record of a learner that failed, a joining generator with another config waits, and one that
  joined under the replaced record stops at its next `run_state`.
- `check_intact` (learner) and `run_state` (generator, every turn) raise `RunLost` naming what is
  missing once Redis no longer holds the run; nothing here re-creates it.
- The `weights` hash is the source of truth for the published version; notifications
  (broker/weights/notify.py) only make reloads prompt. The registry remembers what this process last
  announced, so that an announcement Redis forgot can be made again (broker/channels/audit.py); an
  announcement and its repetition are serialised, so the hash never goes back to an older
  version when a version is announced (or one of the publishing process's remembered) while the
  audit repeats.
- Heartbeat hashes expire after `ttl_s`: a generator that stops beating leaves
  `live_generators`, and weight retention keeps every version a live generator reports loaded.
  The generators are those the learner admitted (broker/channels/roster.py), read without SCAN (which
  would list other runs' keys) and each from its own key, which only it can write.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

from rollflash.broker.channels.lease import RunLease
from rollflash.broker.channels.roster import ACTIVE, statuses
from rollflash.broker.channels.streams import flat
from rollflash.broker.config.fingerprint import Fingerprint, differences, fingerprint_mismatch
from rollflash.broker.connect.keys import GEN_GROUP, LEARNER_GROUP
from rollflash.broker.connect.redis_io import RunMismatch, RunRedis, opt_text, text, wire
from rollflash.broker.wire.schema import SCHEMA_VERSION

log = logging.getLogger(__name__)

Fields = dict[str, str | int | float]


class RunRegistry:
    def __init__(self, io: RunRedis, lease: RunLease | None = None):
        self.io, self.keys = io, io.keys
        self.lease = lease  # the learner's: its writes here are fenced
        self.fingerprint: str | None = None  # set by the learner's `register`
        self.joined: Fingerprint | None = None  # set by a generator's `join`
        self.announced: Fields | None = None  # the last weights this process announced
        self._announcing = threading.Lock()  # announce_weights and announce_again, one at a time

    # --- the run hash ---------------------------------------------------------------------------
    @property
    def _lease(self) -> RunLease:
        assert self.lease is not None, "a learner write without the lease"
        return self.lease

    def ensure_groups(self) -> None:
        """Learner: create the prompts stream and its group, and the learner's (empty) dlq,
        unless they exist."""
        commands: list[Any] = []
        if not self.io.client.exists(self.keys.prompts):
            commands.append(("XGROUP", "CREATE", self.keys.prompts, GEN_GROUP, "0", "MKSTREAM"))
        if not self.io.client.exists(self.keys.dlq):
            commands.append(("XGROUP", "CREATE", self.keys.dlq, "x", "$", "MKSTREAM"))
            commands.append(("XGROUP", "DESTROY", self.keys.dlq, "x"))
        self._lease.execute(commands, "the run's creation")

    def register(self, fingerprint: Fingerprint) -> bytes:
        """Learner: record the run's config fingerprint, or refuse a run with another one;
        returns the run's MAC key (made by its first learner). The fingerprint becomes the
        run's for good once it has trained (its `state` is set, learner/loop.py `begin`): a run
        whose learners all failed before that takes this learner's (not another rank's of the
        same learner: `registered_by`), so a failed start (a mistyped model path) changes
        nothing."""
        fields, mine = self.fields(), self._lease.holder_digest()
        recorded = fields.get("fingerprint")
        replace = (
            "state" not in fields  # never trained
            and recorded not in (None, fingerprint.digest)
            and fields.get("registered_by") != mine  # not another rank of this learner's
        )
        if replace:
            log.warning(
                "run %s: its earlier learner stopped before training with another config (%s); "
                "this one's replaces it",
                self.keys.prefix,
                "; ".join(differences(_json(fields.get("fingerprint_keys")), fingerprint)),
            )
        write = "HSET" if replace else "HSETNX"
        self._lease.execute(
            [
                (write, self.keys.run, "fingerprint", fingerprint.digest),
                (write, self.keys.run, "fingerprint_keys", fingerprint.to_json()),
                ("HSETNX", self.keys.run, "schema", SCHEMA_VERSION),
                ("HSET", self.keys.run, "registered_by", mine),
                ("SET", self.keys.mac_key, secrets.token_hex(32), "NX"),
            ],
            "the run's registration",
        )
        self._check(fingerprint)
        self.fingerprint = fingerprint.digest
        key: Any = self.io.client.get(self.keys.mac_key)
        if key is None:
            raise self.io.lost(f"the MAC key {self.keys.mac_key} is gone")
        return bytes(key)

    def join(self, fingerprint: Fingerprint, timeout_s: float) -> None:
        """Generator: wait (read-only) for the learner to register the run, then check it. A
        run that has not trained yet may hold the config of a learner that failed, which the
        next learner replaces (`register`): another config is waited on until the run trains
        (or `timeout_s` passes), and only then refused."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply: Any = self.io.client.hmget(self.keys.run, ["fingerprint", "state"])
            have, state = opt_text(reply[0]), opt_text(reply[1])
            if have is not None and (have == fingerprint.digest or state is not None):
                break
            if time.monotonic() > deadline:
                if have is not None:
                    break  # refused below, naming the keys
                raise RunMismatch(
                    f"run {self.keys.prefix} was not started by a learner within "
                    f"{timeout_s:.0f}s: start the learner (rollctl start-learner)"
                )
            time.sleep(0.2)
        self._check(fingerprint)
        self.joined = fingerprint

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
        this run's fingerprint), the prompts stream and every admitted generator's stream with
        their consumer groups. Needs XINFO (the learner's ACL user; not the generator's). One
        round trip."""
        streams = [self.keys.prompts]
        streams += [self.keys.trajectories(g) for g, s in statuses(self.io).items() if s == ACTIVE]
        pipe = self.io.pipeline(transaction=False)
        pipe.hget(self.keys.run, "fingerprint")
        for stream in streams:
            pipe.xinfo_groups(stream)
        fingerprint, *groups = pipe.execute(raise_on_error=False)
        if fingerprint is None:
            raise self.io.lost(f"the run hash {self.keys.run} is gone")
        if self.fingerprint is not None and text(fingerprint) != self.fingerprint:
            raise RunMismatch(
                f"run {self.keys.prefix} now has config fingerprint {text(fingerprint)}, "
                f"this learner registered {self.fingerprint}"
            )
        for stream, info in zip(streams, groups):
            group = GEN_GROUP if stream == self.keys.prompts else LEARNER_GROUP
            if group not in {text(g["name"]) for g in self.io.stream_reply(info, stream)}:
                raise self.io.lost(f"the consumer group {group!r} of {stream} is gone")

    def run_state(self) -> str | None:
        """The run's `state` field (None before training starts); raises `RunLost` when the run
        hash is gone. What a generator checks every turn (its ACL allows no XINFO)."""
        fields = self.fields()
        if "fingerprint" not in fields:
            raise self.io.lost(f"the run hash {self.keys.run} is gone")
        if self.joined is not None and fields["fingerprint"] != self.joined.digest:
            raise self._fingerprint_mismatch(self.joined)  # a new learner's, before training
        return fields.get("state")

    def fields(self) -> dict[str, str]:
        return self.io.hash(self.keys.run)

    def set_fields(self, **fields: str | int | float) -> None:
        self._lease.execute([("HSET", self.keys.run, *flat(fields))], "the run hash")

    def count(self, name: str, n: int) -> None:
        """Add `n` to the run hash's counter `name` (learner only: generators may not write it)."""
        self._lease.execute([("HINCRBY", self.keys.run, name, n)], "a run counter")

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
        learner/durability/publish_process.py), so that the audit makes it again if Redis forgets it."""
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
            self._lease.execute([("HSET", self.keys.weights, *flat(announced))], "the weights hash")

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

    def generator_ids(self) -> list[str]:
        """The generators the learner admitted (quarantined ones too) and those asking to join."""
        joined: Any = self.io.client.smembers(self.keys.joined)
        return sorted(set(statuses(self.io)) | {text(g) for g in joined})

    def live_generators(self) -> dict[str, dict[str, str]]:
        """Each live generator's status hash (its heartbeat), read in one pipeline."""
        ids = self.generator_ids()
        if not ids:
            return {}
        pipe = self.io.client.pipeline(transaction=False)
        for gid in ids:
            pipe.hgetall(self.keys.gen(gid))
        out = {}
        for gid, raw in zip(ids, pipe.execute()):
            if raw:  # no heartbeat (expired, or never beat)
                out[gid] = {text(k): text(v) for k, v in raw.items()}
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
        """Each stream's length and its consumer groups' consumers, pending and lag: the
        prompts, every admitted generator's trajectories (`traj:{id}`), the learner's dlq."""
        names = [("prompts", self.keys.prompts)]
        names += [(f"traj:{g}", self.keys.trajectories(g)) for g in sorted(statuses(self.io))]
        out = {}
        for name, key in names + [("dlq", self.keys.dlq)]:
            length: Any = self.io.client.xlen(key)
            out[name] = {"length": length, "groups": self._groups(key)}
        return out

    def quarantined(self) -> dict[str, str]:
        """Quarantined generator id -> why (broker/channels/roster.py)."""
        return {
            g: s.removeprefix("quarantined ")
            for g, s in statuses(self.io).items()
            if s.startswith("quarantined")
        }

    def dead_letters_by_code(self) -> dict[str, int]:
        """Entries dead-lettered so far, by reason code (broker/wire/wire.py)."""
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


def _json(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}


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
