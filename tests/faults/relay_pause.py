"""Run `rollctl` with a pause installed in this process's relay server (the harness's seam; the
product reads nothing of it): the first time it serves another generator a range of a version at
or after $RELAY_PAUSE_FROM, the process stops itself with SIGSTOP, inside that request, so the test
can kill -9 it while the other generator is fetching from it.

    python tests/faults/relay_pause.py start-generator --config ...
"""

from __future__ import annotations

import os
import signal
import sys

from rollflash.broker.weights import weight_server

PAUSE_FROM = int(os.environ["RELAY_PAUSE_FROM"])
_serve_file = weight_server.WeightServer._file


async def _paused_file(self, request):
    relaying = self._store is None  # a generator's relay; the learner serves from its store
    if relaying and "Range" in request.headers and int(request.match_info["version"]) >= PAUSE_FROM:
        os.kill(os.getpid(), signal.SIGSTOP)
    return await _serve_file(self, request)


weight_server.WeightServer._file = _paused_file

if __name__ == "__main__":
    from rollflash.rollctl.cli import main

    sys.argv = ["rollctl", *sys.argv[1:]]
    main()
