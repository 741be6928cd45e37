"""Fault windows: set ROLLFLASH_PAUSE_AT=<point>:<step> and the learner stops itself with SIGSTOP
the first time it passes that point at that step or a later one, so a fault test can kill -9 it
inside that exact window. Points:
after_read (a step's groups read, not trained), after_update (trained and published, not
checkpointed), after_checkpoint (durable, its entries not yet acknowledged), before_ack (the
first dropped entries of the step recorded in the ledger, not yet acknowledged)."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def pause_point(name: str, step: int) -> None:
    """Stop this process here when ROLLFLASH_PAUSE_AT names this point (fault tests)."""
    point, _, at = os.environ.get("ROLLFLASH_PAUSE_AT", "").partition(":")
    if point == name and at.isdigit() and step >= int(at):
        os.environ.pop("ROLLFLASH_PAUSE_AT")  # once
        log.warning("pausing at %s of step %d (ROLLFLASH_PAUSE_AT)", name, step)
        os.kill(os.getpid(), signal.SIGSTOP)
