"""Which generators may write, and what the learner does when one misbehaves.

Joining: a generator writes its heartbeat (`gen:{id}`, its own key), adds its id to the set
`joined` and waits. The learner's rank 0 admits each joined id that has a heartbeat (`admit`):
it creates `traj:{id}` with the group `learner` and `dlq:{id}`, and sets `generators[id]` to
`active`; from then on every rank reads that stream. A generator's credentials reach only its own
keys (broker/connect/acl.py), so the heartbeat proves who asks. The learner user needs no SCAN: the
learner knows its generators from `generators` and `joined`.

Checking (`check_streams`, rank 0, every few seconds): a generator's stream must be exactly what
its writer's XADDs and the learner's own trims left, i.e. entries-added - trimmed by the learner
= length (else `trimmed`: another client deleted entries, e.g. `XADD ... MAXLEN 0`); its last id
must not lie in the future (`bricked`: `XADD` with id 2^64-1 makes every later XADD fail); its
entries not yet acknowledged must stay under a bound no honest generator reaches (`flooded`: four
times what admission lets be in flight and a checkpoint interval's trained entries hold,
learner/build.py). The same call trims what the learner group
has acknowledged (below its oldest pending entry) once it is `redis.keep_acknowledged_s` old
(readable with redis-cli XRANGE until then), so memory stays flat.
A stream that is gone, or lost its group, means Redis lost the run (`RunLost`).

Quarantine (`quarantine`): `generators[id]` becomes `quarantined <reason>`; its entries are
refused from then on (the ranks stop reading its stream and drop what they hold of it), rank 0
issues its pending prompts again (`sweep`, also prompts it steals later) and the prompts it had
answered come back through broker/channels/inflight.py; its stream is kept at `QUARANTINE_KEEP` entries,
for inspection (`contain`, every watch, however much it goes on adding). Training goes on with
the other generators. `rollctl status` lists it.

Retiring (`retire_idle`): a generator whose heartbeat expired `RETIRE_AFTER_S` ago and whose
stream is fully acknowledged is forgotten, so the key space stays flat however many generators
come and go. A quarantined generator is kept.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollflash.broker.channels.lease import RunLease
from rollflash.broker.channels.streams import PromptQueue
from rollflash.broker.connect.keys import GEN_GROUP, valid_name
from rollflash.broker.connect.redis_io import RunRedis, text

log = logging.getLogger(__name__)

FUTURE_MS = 60_000  # an entry id this far past Redis's clock was not made by XADD `*`
QUARANTINE_KEEP = 10  # entries of a quarantined generator's stream kept for inspection
RETIRE_AFTER_S = 600.0  # a silent generator is forgotten this long after its heartbeat expired
ACTIVE = "active"


def statuses(io: RunRedis) -> dict[str, str]:
    """generator id -> `active` or `quarantined <reason>` (the `:trimmed` counters left out)."""
    return {k: v for k, v in io.hash(io.keys.generators).items() if ":" not in k}


class Roster:
    """The learner's side (rank 0 writes; every rank reads `active`)."""

    def __init__(
        self, io: RunRedis, lease: RunLease, max_unacked: int, keep_acknowledged_s: float = 0.0
    ):
        self.io, self.keys, self.lease = io, io.keys, lease
        self.max_unacked = max_unacked  # entries of one stream not yet acknowledged: above, flooded
        self.keep_ms = int(keep_acknowledged_s * 1000)  # acknowledged entries stay this long
        self._silent_since: dict[str, float] = {}

    def statuses(self) -> dict[str, str]:
        return statuses(self.io)

    def active(self) -> list[str]:
        return sorted(g for g, s in self.statuses().items() if s == ACTIVE)

    def admit_joined(self) -> list[str]:
        """Admit the joined ids that have a heartbeat; returns those admitted now."""
        out = []
        joined: Any = self.io.client.smembers(self.keys.joined)
        for raw in joined:
            gid = text(raw)
            if not valid_name(gid):
                self.lease.execute([("SREM", self.keys.joined, raw)])
                continue
            k = self.keys
            keys = [k.generators, k.joined, k.trajectories(gid), k.generator_dlq(gid), k.gen(gid)]
            status = self.lease.call("admit", keys, [gid], "a generator's admission")
            if status is not None and text(status) == ACTIVE:
                log.info("generator %s joined", gid)
                out.append(gid)
        return out

    def contain(self, quarantined: list[str]) -> None:
        """Keep quarantined generators' streams at `QUARANTINE_KEEP` entries: one that goes on
        adding (a flood) costs Redis no more than that."""
        if quarantined:
            k = self.keys
            trims = [("XTRIM", k.trajectories(g), "MAXLEN", QUARANTINE_KEEP) for g in quarantined]
            self.lease.execute(trims, "a quarantined stream's trim")

    def quarantine(self, gid: str, reason: str) -> bool:
        """Quarantine an active generator (any rank may); returns whether it was active."""
        reason = " ".join(reason.split())[:200]
        keys = [self.keys.generators, self.keys.run]
        done = int(self.lease.call("quarantine", keys, [gid, reason], "a quarantine")) == 1
        if done:
            log.error("generator %s is quarantined: %s; its entries are refused", gid, reason)
            self.contain([gid])
        return done

    def check_streams(self, keep: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Check and trim every active generator's stream (module docstring), keeping the
        entries from `keep[stream]` on (the loss auditor's witness, broker/channels/audit.py);
        quarantines the ones that fail. Returns, per stream that passed, its length (after the
        trim), entries added and last id."""
        out = {}
        for gid in self.active():
            stream = self.keys.trajectories(gid)
            args = [gid, FUTURE_MS, self.max_unacked, keep.get(stream, ""), self.keep_ms]
            reply = self.lease.call(
                "check_stream", [stream, self.keys.generators], args, "a stream check"
            )
            verdict = text(reply[0])
            if verdict in ("missing", "nogroup"):
                raise self.io.lost(f"the stream {stream} (or its group) is gone")
            if verdict != "ok":
                self.quarantine(gid, f"stream {verdict}: {text(reply[1])}")
                continue
            out[stream] = {
                "length": int(reply[1]),
                "entries-added": int(reply[2]),
                "last": text(reply[3]),
            }
        return out

    def sweep(self, owners: list[str]) -> int:
        """Issue again the prompts pending for quarantined `owners` (acknowledged for them);
        returns how many. Unknown entries (not issued by the learner) are only acknowledged."""
        if not owners:
            return 0
        issued = {text(pe): text(t) for t, pe in self.io.hash(self.keys.inflight).items()}
        again = 0
        for owner in owners:
            pending: Any = self.io.client.xpending_range(
                self.keys.prompts, GEN_GROUP, "-", "+", 10_000, consumername=owner
            )
            ids = [text(p["message_id"]) for p in pending]
            pairs = [(issued[i], i) for i in ids if i in issued]
            strays = [i for i in ids if i not in issued]
            if strays:
                self.lease.execute([("XACK", self.keys.prompts, GEN_GROUP, *strays)])
            again += len(self.reissue(pairs, owner))
        return again

    def reissue(self, pairs: list[tuple[str, str]], owner: str) -> list[str]:
        done = PromptQueue(self.io, 0, self.lease).reissue(pairs, owner)
        if done:
            log.warning("issued %d prompts of %s again", len(done), owner or "lost answers")
        return done

    def retire_idle(self, now: float | None = None) -> list[str]:
        """Forget active generators silent for RETIRE_AFTER_S whose stream is fully read."""
        now = time.time() if now is None else now
        out = []
        for gid in self.active():
            if self.io.client.exists(self.keys.gen(gid)):
                self._silent_since.pop(gid, None)
                continue
            if now - self._silent_since.setdefault(gid, now) < RETIRE_AFTER_S:
                continue
            k = self.keys
            keys = [k.generators, k.trajectories(gid), k.generator_dlq(gid), k.gen(gid)]
            if int(self.lease.call("retire", keys, [gid], "a retirement")) == 1:
                log.info("generator %s retired: silent for %.0fs", gid, RETIRE_AFTER_S)
                self._silent_since.pop(gid, None)
                out.append(gid)
        return out
