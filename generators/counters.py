"""What a generator process counts and reports in its heartbeat, and how it is asked to stop."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass
class Counters:
    groups: int = 0
    samples: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    seq_s: float = 0.0  # continuous batching: sum over decode steps of sequences x step time
    restarted: int = 0  # continuous batching: groups started again, too stale to be trained

    def as_fields(self) -> dict[str, str | int | float]:
        total = self.busy_s + self.idle_s
        fields: dict[str, str | int | float] = {
            "groups": self.groups,
            "samples": self.samples,
            "tokens": self.tokens,
            "busy_s": round(self.busy_s, 2),
            "idle_frac": round(self.idle_s / total, 3) if total else 0.0,
        }
        if self.seq_s:  # mean sequences in flight while busy
            fields["mean_batch"] = round(self.seq_s / self.busy_s, 1)
            fields["restarted"] = self.restarted
        return fields


class StopSignals:
    """Turns SIGTERM / SIGINT into a flag the loop checks between batches."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
