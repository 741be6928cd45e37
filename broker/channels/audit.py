"""Forensics on writes Redis acknowledged and then forgot.

Redis with `appendfsync everysec` (or no fsync) may come back from a crash without its last
writes. Redis comes back with a prefix of its history, so each witness compares what it saw with
what is left, repairs what it can and counts the rest:
- prompts: the learner is the only writer of the prompts stream. `LossAuditor.verify_prompts`
  re-checks, at most once a second and before adding more, that the prompts it added are still
  there, re-adds the forgotten ones and counts them (`lost["prompts"]`, run hash
  `redis_lost_prompts`).
- trajectories come back by themselves: a prompt's XACK is in the same transaction as its
  trajectory (broker/channels/streams.py), so the prompt is pending again and is generated again. Two
  witnesses count the lost write, each from its own side, so the same write may be counted by
  both (report both; never add them up):
  - its writer, if the same process is still alive, recognises the prompt when it comes back
    (`CompletedPrompts`, `lost["trajectories"]`, heartbeat `redis_lost`). A writer that died or
    restarted cannot;
  - the learner's rank 0, whoever wrote it (`LossAuditor.verify_trajectories`, at most once a
    second, for every admitted generator's stream): it remembers each stream's `entries-added`
    and last id as it last saw them; once that id is gone, `entries-added` minus the entries
    after it is what Redis still holds of what the learner saw, and the difference is counted
    (`lost["trajectory_writes"]`, run hash `redis_lost_trajectory_writes`). `entries-added`
    alone would miss it once generators write again before the learner's next look.
  What neither counts as a Redis loss: a write added after the learner's last look (up to a second
  while it reads, a whole training step while it trains) whose writer also died or restarted; and
  what Redis forgot before a (re)started learner's first look. Such a write is still not silent:
  its prompt comes back to a generator as a re-delivered entry (own pending, or taken over), the
  new trajectory is marked `retried`, and the learner counts it (run hash `prompts_retried`), as
  it counts the prompts of a generator that died before answering.
- weights: an announcement Redis forgot is made again (`LossAuditor.verify_weights`): re-added
  prompts may name that version, and generators wait until the `weights` hash does.
A Redis that lost the whole run is not repaired: `LossAuditor.watch` runs the registry's
`check_intact`, which raises `RunLost`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque

from rollflash.broker.channels.registry import RunRegistry
from rollflash.broker.channels.roster import Roster
from rollflash.broker.channels.streams import Issued, PromptQueue
from rollflash.broker.connect.redis_io import RunRedis, entry_key, text
from rollflash.broker.wire.schema import PromptWork

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0  # how often the learner's reads re-check that Redis still holds the run
RECENT_PROMPTS = 4096  # prompt entries the learner remembers, to re-add any Redis forgets
RECENT_COMPLETIONS = 65536  # prompts a generator remembers finishing, to spot forgotten ones
COUNT_CHUNK = 256  # entries per XRANGE when counting the trajectories added after a restart


class LossAuditor:
    """The learner's witness: repairs and counts what Redis forgot (module docstring)."""

    def __init__(
        self,
        io: RunRedis,
        registry: RunRegistry,
        prompts: PromptQueue,
        roster: Roster,
        watch_interval_s: float = WATCH_INTERVAL_S,
    ):
        self.io, self.keys, self.registry, self.prompts = io, io.keys, registry, prompts
        self.roster = roster
        self.watch_interval_s = watch_interval_s
        self.lost: Counter[str] = Counter()  # prompts, trajectory_writes, weights
        self._recent_prompts: deque[Issued] = deque(maxlen=RECENT_PROMPTS)
        self._last_issued: int | None = None
        # the last look at each generator's stream: stream -> (entries-added, last id)
        self._trajectory_writes: dict[str, tuple[int, str]] | None = None
        self._next_watch = 0.0

    def due(self) -> bool:
        """Whether a watch is due (at most every `watch_interval_s`, once registered)."""
        return self.registry.fingerprint is not None and time.monotonic() >= self._next_watch

    def defer_watch(self, s: float) -> None:
        """The next watch is due in `s` seconds."""
        self._next_watch = time.monotonic() + s

    def watch(self) -> None:
        """If due: `check_intact`, `verify_prompts`, `verify_trajectories`, `verify_weights`."""
        if not self.due():
            return
        self._next_watch = time.monotonic() + self.watch_interval_s
        self.registry.check_intact()
        self.verify_prompts()
        self.verify_trajectories()
        self.verify_weights()

    # --- prompts ----------------------------------------------------------------------------------
    def added_prompts(self, added: list[Issued], issued: int | None) -> None:
        """Remember prompts just added (entry id, fields, traj_id), to re-add any Redis
        forgets."""
        self._recent_prompts.extend(added)
        self._last_issued = issued if issued is not None else self._last_issued

    def verify_prompts(self) -> int:
        """Re-add prompts Redis acknowledged and then forgot; returns how many. The learner is
        the only writer of the prompts stream, so any of our entries above the stream's last id
        is one Redis lost."""
        if not self._recent_prompts:
            return 0
        last_id = text(self.io.stream_info(self.keys.prompts)["last-generated-id"])
        last = entry_key(last_id)
        if entry_key(self._recent_prompts[-1][0]) <= last:
            return 0
        if entry_key(self._recent_prompts[0][0]) > last:
            raise self.io.lost(
                f"it forgot more than the last {RECENT_PROMPTS} prompts "
                f"(the stream ends at {last_id})"
            )
        kept = [p for p in self._recent_prompts if entry_key(p[0]) <= last]
        forgotten = [(f, t) for i, f, t in self._recent_prompts if entry_key(i) > last]
        log.error(
            "Redis forgot %d prompts it had acknowledged (restart with appendfsync "
            "everysec?); adding them again",
            len(forgotten),
        )
        ids = self.prompts.add_encoded(forgotten, self._last_issued)
        again = [(i, f, t) for i, (f, t) in zip(ids, forgotten)]
        self._recent_prompts = deque(kept + again, maxlen=RECENT_PROMPTS)
        self.lost["prompts"] += len(forgotten)
        self.registry.count("redis_lost_prompts", len(forgotten))
        return len(forgotten)

    # --- trajectories -----------------------------------------------------------------------------
    def track_trajectory_writes(self) -> None:
        """Rank 0: from now on `verify_trajectories` counts trajectory writes Redis forgets. It
        starts from the streams as they are now: what Redis forgot before is not seen."""
        self._trajectory_writes = {}

    def verify_trajectories(self) -> int:
        """Rank 0 (after `track_trajectory_writes`): count trajectory writes, by any generator,
        that Redis acknowledged and then forgot; returns how many.

        If the last entry we saw of a stream is still there nothing we saw was lost. If it is
        gone, every entry after it was added since the restart, so entries-added minus those
        entries is how many of the `seen` Redis kept. A stream seen for the first time starts
        from what it holds."""
        if self._trajectory_writes is None:
            return 0
        forgotten = 0
        for gid in self.roster.active():
            stream = self.keys.trajectories(gid)
            seen, last = self._trajectory_writes.get(stream, (0, "0-0"))
            still_there, added, now_last = self._look(stream, last if seen else None)
            if not still_there:
                forgotten += max(0, seen - (added - self._count_between(stream, last, now_last)))
            self._trajectory_writes[stream] = (added, now_last)
        if forgotten:
            log.error(
                "Redis forgot %d trajectory writes it had acknowledged (restart with "
                "appendfsync everysec?); their prompts are delivered and generated again",
                forgotten,
            )
            self.lost["trajectory_writes"] += forgotten
            self.registry.count("redis_lost_trajectory_writes", forgotten)
        return forgotten

    def witnesses(self) -> dict[str, str]:
        """stream -> the entry id `verify_trajectories` looks for next: trimming keeps it."""
        return {s: last for s, (_, last) in (self._trajectory_writes or {}).items()}

    def _look(self, stream: str, entry_id: str | None) -> tuple[bool, int, str]:
        """Whether `entry_id` (None: skip) is in `stream`, its entries-added and last id; one
        round trip, so a restart cannot fall between the answers."""
        pipe = self.io.pipeline(transaction=False)
        if entry_id is not None:
            pipe.xrange(stream, entry_id, entry_id)
        pipe.xinfo_stream(stream)
        *found, info = pipe.execute(raise_on_error=False)
        info = self.io.stream_reply(info, stream)
        return (
            bool(found[0]) if found else True,
            int(info["entries-added"]),
            text(info["last-generated-id"]),
        )

    def _count_between(self, stream: str, after: str, upto: str) -> int:
        """Entries of `stream` with ids in (after, upto]; only run after Redis forgot some."""
        n, start = 0, f"({after}"
        while True:
            chunk = self.io.xrange(stream, start, upto, count=COUNT_CHUNK)
            n += len(chunk)
            if len(chunk) < COUNT_CHUNK:
                return n
            start = f"({chunk[-1][0]}"

    # --- weights ----------------------------------------------------------------------------------
    def verify_weights(self) -> bool:
        """Rank 0: announce the last published version again if Redis forgot it: prompts re-added
        by `verify_prompts` may name it, and a generator waits for the hash to. Returns whether
        it had to."""
        announced = self.registry.announced
        if announced is None:
            return False
        have = self.io.hget(self.keys.weights, "version")
        if have is not None and int(have) >= int(announced["version"]):
            return False
        log.error(
            "Redis forgot that weights v%d were published (it says v%s); announcing them again",
            announced["version"],
            have,
        )
        self.lost["weights"] += 1
        self.registry.announce_again()
        return True


class CompletedPrompts:
    """A generator's witness: the prompts it finished (its trajectory added and the prompt
    acknowledged in one transaction). One that is delivered again means Redis forgot both."""

    def __init__(self) -> None:
        self.lost: Counter[str] = Counter()  # trajectories
        self._done: OrderedDict[tuple[str, int], None] = OrderedDict()

    def finished(self, group_id: str, sample_index: int) -> None:
        self._done[(group_id, sample_index)] = None
        if len(self._done) > RECENT_COMPLETIONS:
            self._done.popitem(last=False)

    def check(self, claimed: list[tuple[str, PromptWork]]) -> None:
        """Count the claimed prompts this process had already finished."""
        for _, work in claimed:  # a prompt the learner issued again is not Redis forgetting
            if not work.reissued and (work.group_id, work.sample_index) in self._done:
                self.lost["trajectories"] += 1
                log.error(
                    "Redis forgot the trajectory of %s/%d it had acknowledged (restart "
                    "with appendfsync everysec?); generating it again",
                    work.group_id,
                    work.sample_index,
                )
