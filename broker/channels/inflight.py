"""Prompts whose answer will never come, found and issued again (the learner's rank 0).

`inflight` maps the traj_id of every issued prompt to its prompt entry until the learner is done
with it (trained, or dropped and replaced: broker/channels/trajectories.py). A prompt is lost when a
generator acknowledged it but no usable trajectory answering it reached the learner:
- its generator was quarantined (its answers are refused, or its stream was trimmed before the
  learner read them);
- its only answer was rejected (dead-lettered) by the learner or by a generator;
- a generator acknowledged a prompt another one held (a generator's credentials can XACK any
  prompt: Redis cannot restrict XACK by consumer).
Finding them needs no record of who answered what, only one rule: an honest generator
acknowledges a prompt in the same function call that adds its trajectory to a live stream. So:

1. snapshot (`_begin`, one MULTI): `inflight`, the prompts the generators still hold (pending)
   or have not claimed yet; the candidates are the others (acknowledged). Then each live stream's
   last id, taken after that: every answer to a candidate that lies in a live stream is at or
   below it;
2. once every rank has read each live stream up to that id (`drained`, checked before this
   iteration's reads), an answer to a candidate has reached some rank: a candidate that is still
   in `inflight` and that no rank holds (`held`, every rank's traj_ids gathered after that
   check) is lost;
3. `reissue` adds it again as a new entry with the same fields (traj_id, issued version, MAC),
   in a fenced call that skips it if its entry moved on or is pending again. A traj_id issued
   again `MAX_REISSUES` times is given up: removed from `inflight` and replaced by a fresh prompt.
A wrongly suspected prompt (its answer reached a rank between the check and the gather) costs one
duplicate, dropped by traj_id. With several ranks, rank 0 asks for `held` one iteration ahead
(`want_held`), so every rank sends it in the same gather (learner/intake/collect.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from rollflash.broker.channels.lease import RunLease
from rollflash.broker.channels.roster import Roster
from rollflash.broker.connect.keys import GEN_GROUP, LEARNER_GROUP
from rollflash.broker.connect.redis_io import RunRedis, entry_key, text

log = logging.getLogger(__name__)

INTERVAL_S = 5.0  # how often a snapshot is taken
MAX_REISSUES = 3


class LostPrompts:
    def __init__(
        self, io: RunRedis, lease: RunLease, roster: Roster, interval_s: float = INTERVAL_S
    ):
        self.io, self.keys, self.lease, self.roster = io, io.keys, lease, roster
        self.interval_s = interval_s
        self.reissues: Counter[str] = Counter()  # traj_ids still in flight only (`_begin`)
        self.lost = 0  # prompts issued again, over this process's life
        self._candidates: dict[str, str] | None = None  # traj_id -> prompt entry id
        self._marks: dict[str, str] = {}  # live stream -> its last id at the snapshot
        self._drained = False
        self._next = 0.0

    @property
    def want_held(self) -> bool:
        """Whether the next iteration's gather must carry every rank's held traj_ids."""
        return self._candidates is not None

    def before_read(self) -> None:
        """Take a snapshot when one is due, or check whether the last one is drained."""
        self._drained = False
        if self._candidates is None:
            if time.monotonic() >= self._next:
                self._begin()
        else:
            self._drained = self._drained_now()

    def after_gather(self, held: set[str] | None) -> int:
        """Issue again the candidates no rank holds, once drained; returns how many."""
        if self._candidates is None or not self._drained or held is None:
            return 0
        lost = [(t, pe) for t, pe in self._candidates.items() if t not in held]
        self._candidates, self._next = None, time.monotonic() + self.interval_s
        return self._reissue(lost) if lost else 0

    def _begin(self) -> None:
        live = [self.keys.trajectories(g) for g in self.roster.active()]
        pipe = self.io.pipeline(transaction=True)
        pipe.hgetall(self.keys.inflight)
        pipe.xpending_range(self.keys.prompts, GEN_GROUP, "-", "+", 1_000_000)
        pipe.xinfo_groups(self.keys.prompts)
        for stream in live:
            pipe.xinfo_stream(stream)
        inflight, pending, groups, *infos = pipe.execute(raise_on_error=False)
        groups = self.io.stream_reply(groups, self.keys.prompts)
        gen: Any = next((g for g in groups if text(g["name"]) == GEN_GROUP), None)
        if gen is None or isinstance(pending, Exception):
            return  # the audit's check_intact reports a lost group
        claimed = entry_key(text(gen["last-delivered-id"]))
        held = {text(p["message_id"]) for p in pending}
        candidates = {
            text(t): text(pe)
            for t, pe in inflight.items()
            if text(pe) not in held and entry_key(text(pe)) <= claimed
        }
        issued = {text(t) for t in inflight}
        self.reissues = Counter({t: n for t, n in self.reissues.items() if t in issued})
        if not candidates:
            self._next = time.monotonic() + self.interval_s
            return
        self._marks = {
            s: text(i["last-generated-id"])
            for s, i in zip(live, infos)
            if not isinstance(i, Exception)
        }
        self._candidates = candidates

    def _drained_now(self) -> bool:
        active = {self.keys.trajectories(g) for g in self.roster.active()}
        marks = {s: m for s, m in self._marks.items() if s in active}
        pipe = self.io.pipeline(transaction=False)
        for stream in marks:
            pipe.xinfo_groups(stream)
        for mark, groups in zip(marks.values(), pipe.execute(raise_on_error=False)):
            if isinstance(groups, Exception):
                return False
            g = next((g for g in groups if text(g["name"]) == LEARNER_GROUP), None)
            if g is None or entry_key(text(g["last-delivered-id"])) < entry_key(mark):
                return False
        return True

    def _reissue(self, lost: list[tuple[str, str]]) -> int:
        again: list[tuple[str, str]] = []
        give_up: list[tuple[str, str]] = []
        for t, pe in lost:
            (give_up if self.reissues[t] >= MAX_REISSUES else again).append((t, pe))
        done = self.roster.reissue(again, "")
        self.reissues.update(done)
        if give_up:
            log.error(
                "%d prompts were answered with nothing usable %d times; replacing them by fresh "
                "ones", len(give_up), MAX_REISSUES,
            )  # fmt: skip
            self.lease.execute(
                [
                    ("HDEL", self.keys.inflight, *[t for t, _ in give_up]),
                    ("HINCRBY", self.keys.run, "replaced", len(give_up)),
                ]
            )
            for t, _ in give_up:
                del self.reissues[t]
        self.lost += len(done)
        return len(done) + len(give_up)
