"""Stopping the learner on SIGTERM or SIGINT: how Kubernetes, Slurm, a terminal's Ctrl-C,
`rollctl run` and the Python API stop it.

The first signal asks for a stop at the next step boundary. A step being trained, published or
checkpointed finishes; a step still waiting for its groups stops waiting, having trained nothing:
the collector's wait limit becomes 0, so the wait ends as a timed-out one does (learner/intake/collect.py
`NoData`), on every rank at the same read, since rank 0's verdict is every rank's. The learner
then checkpoints the steps since its last checkpoint, marks the run `stopped`, releases the run's
lease and ends with `Stopped` (rollflash/errors.py): one line, exit code 128 + the signal's
number. The same command resumes at once, from that checkpoint.

A second signal stops at once, wherever the learner is: the guarantees of a kill -9 (nothing
lost, nothing trained twice; the steps after the last checkpoint are trained again on resume),
and the lease is released on the way out (broker/channels/lease.py), so the same command resumes at once
here too.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from rollflash.errors import Stopped

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def stopped_cleanly(signum: int, step: int) -> Stopped:
    """The learner's last word after a stop at a step boundary."""
    return Stopped(
        f"stopped by {signal_name(signum)} after step {step}: checkpointed, the run's lease "
        "released; the same command resumes",
        signum,
    )


def stopped_at_once(signum: int, step: int) -> Stopped:
    """The learner's last word after a second signal."""
    return Stopped(
        f"stopped at once by a second {signal_name(signum)} at step {step}: the run's lease "
        "released; the same command resumes from the last checkpoint",
        signum,
    )


class StopSignals:
    """SIGTERM and SIGINT handlers while the learner runs (module docstring); the previous
    handlers come back on exit. Outside the main thread (a learner started from a test's thread)
    signals cannot be handled, and nothing is installed."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, Any] = {}
        self._on_request: Callable[[], None] = lambda: None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def on_request(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the first signal (at once if it has come already)."""
        self._on_request = fn
        if self.requested:
            fn()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            name = signal_name(signum)
            log.warning(
                "%s: stopping at the next step boundary, then checkpointing (%s again stops at once)",
                name,
                name,
            )
            self._on_request()
            return
        raise Stopped(f"stopped at once by a second {signal_name(signum)}", signum)
