"""Run `rollctl` with a hook at the learner's pause points (learner/pause.py; the harness's seam:
the product reads nothing of it): the first time the learner passes point P at step S or a later
one, with $LEARNER_PAUSE_AT = "P:S", the process stops itself with SIGSTOP, so the test can
kill -9 it inside that exact window.

    python tests/faults/learner_pause.py start-learner --config ...
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from rollflash.learner.pause import on_pause_point

POINT, _, AT = os.environ["LEARNER_PAUSE_AT"].partition(":")
_paused = False


def _stop_once(name: str, step: int) -> None:
    global _paused
    if not _paused and name == POINT and step >= int(AT):
        _paused = True
        logging.getLogger(__name__).warning("pausing at %s of step %d", name, step)
        os.kill(os.getpid(), signal.SIGSTOP)


on_pause_point(_stop_once)

if __name__ == "__main__":
    from rollflash.rollctl.cli import main

    sys.argv = ["rollctl", *sys.argv[1:]]
    main()
