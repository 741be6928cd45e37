"""The fault tests' hook at the learner's fault points (learner/process/hooks.py): a learner started with
$ROLLFLASH_LEARNER_HOOK = "learner_pause:stop_once" (and this folder on its PYTHONPATH) and
$LEARNER_PAUSE_AT = "P:S" stops itself with SIGSTOP the first time it passes point P at step S or
a later one, so the test can kill -9 it inside that exact window (`env`)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

_paused = False


def env(window: str) -> dict[str, str]:
    """The environment that installs the hook, stopping at `window` ("point:step")."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {
        "ROLLFLASH_LEARNER_HOOK": "learner_pause:stop_once",
        "LEARNER_PAUSE_AT": window,
        "PYTHONPATH": path,
    }


def stop_once(point: str, step: int) -> None:
    global _paused
    name, _, at = os.environ["LEARNER_PAUSE_AT"].partition(":")
    if not _paused and point == name and step >= int(at):
        _paused = True
        logging.getLogger(__name__).warning("pausing at %s of step %d", point, step)
        os.kill(os.getpid(), signal.SIGSTOP)
