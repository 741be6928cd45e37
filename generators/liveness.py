"""How long a generator's heartbeat lives and how long its claimed prompts stay its own, scaled
with the pace of the run (`rollout.heartbeat_ttl_s` and `rollout.reclaim_idle_s` are floors).

A generator beats once a turn of its loop (a pull: claim, wait for weights, generate, score,
stream), so its status hash must outlive the longest turn; a prompt it claimed stays pending,
unacknowledged, until its group is streamed, which takes the wait for the version it was issued
for (a learner step or more), a reload and the generation. With a 7B model a learner step can
take minutes: fixed 30 s / 120 s would let the status hash expire between beats and let another
generator take over prompts still being worked on, which are then generated twice. So each
generator measures, over its last `WINDOW` observations of each:
- its turn: the time between two beats;
- the learner's step: the time between two versions it sees loaded, divided by how many versions
  they are apart;
- its hold: from a prompt's claim to its group being streamed;
takes the 75th percentile of each (a typical long one: a single outlier, such as a process
stopped for a while, does not count) and uses
    heartbeat_ttl_s = max(rollout.heartbeat_ttl_s, 3 x turn)
    reclaim_idle_s  = max(rollout.reclaim_idle_s, 3 x max(hold, step + turn)).
Every generator of a run sees the same learner, so their reclaim times agree to within their own
turns. Before anything is measured the configured values hold.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from rollflash.broker.config.config import RolloutConfig

log = logging.getLogger(__name__)

WINDOW = 16  # observations of each kind that count
FACTOR = 3.0  # the margin over what was measured
LOG_GROWTH = 1.5  # a new value is logged once it is this much above the last one logged


class Liveness:
    def __init__(self, rollout: RolloutConfig, clock: Callable[[], float] = time.monotonic):
        self.floor_ttl, self.floor_reclaim = rollout.heartbeat_ttl_s, rollout.reclaim_idle_s
        self.clock = clock
        self.turns: deque[float] = deque(maxlen=WINDOW)
        self.holds: deque[float] = deque(maxlen=WINDOW)
        self.steps: deque[float] = deque(maxlen=WINDOW)  # seconds per version
        self.last_beat: float | None = None
        self.last_version: tuple[float, int] | None = None  # (when first seen loaded, version)
        self.logged = (self.floor_ttl, self.floor_reclaim)

    def beat(self, loaded_version: int) -> None:
        """One turn of the loop ended (the generator heartbeats now) with `loaded_version`."""
        now = self.clock()
        if self.last_beat is not None:
            self.turns.append(now - self.last_beat)
        self.last_beat = now
        if self.last_version is None or loaded_version > self.last_version[1]:
            if self.last_version is not None:
                seen, version = self.last_version
                self.steps.append((now - seen) / (loaded_version - version))
            self.last_version = (now, loaded_version)
        self._log_growth()

    def held(self, seconds: float) -> None:
        """A claimed prompt's group was streamed `seconds` after its claim."""
        self.holds.append(seconds)

    @property
    def step_s(self) -> float:
        """The learner's seconds per version, from the versions seen loaded (0: unknown)."""
        return _p75(self.steps)

    @property
    def heartbeat_ttl_s(self) -> float:
        return max(self.floor_ttl, FACTOR * _p75(self.turns))

    @property
    def reclaim_idle_s(self) -> float:
        busy = max(_p75(self.holds), self.step_s + _p75(self.turns))
        return max(self.floor_reclaim, FACTOR * busy)

    @property
    def reclaim_idle_ms(self) -> int:
        return int(self.reclaim_idle_s * 1000)

    def describe(self) -> str:
        return (
            f"heartbeat_ttl_s {self.floor_ttl:g} and reclaim_idle_s {self.floor_reclaim:g}, "
            f"raised to {FACTOR:g}x the measured turn and {FACTOR:g}x the hold or learner step "
            "+ turn (generators/liveness.py)"
        )

    def _log_growth(self) -> None:
        ttl, reclaim = self.heartbeat_ttl_s, self.reclaim_idle_s
        if ttl > LOG_GROWTH * self.logged[0] or reclaim > LOG_GROWTH * self.logged[1]:
            log.info(
                "heartbeat TTL %.0fs, reclaim after %.0fs (learner step %.1fs, turn %.1fs, "
                "hold %.1fs)",
                ttl,
                reclaim,
                self.step_s,
                _p75(self.turns),
                _p75(self.holds),
            )
            self.logged = (ttl, reclaim)


def _p75(values: deque[float]) -> float:
    """The 75th percentile (nearest rank) of `values`; 0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[-(-3 * len(ordered) // 4) - 1]
