"""Run `rollctl` with a generator fault installed (the harness's seam; the product reads nothing
of it): from version $SKIP_FROM on, the weight follower takes every version as loaded without
handing it to the engine, which keeps computing with the weights it had: the silent failure of a
generator that reports one version and serves another.

    python tests/faults/skip_update.py start-generator --config ...
"""

from __future__ import annotations

import os
import sys

from rollflash.generators import reload

SKIP_FROM = int(os.environ["SKIP_FROM"])
_swap = reload.WeightFollower._swap


def _skipping(self, staged):
    if staged.version < SKIP_FROM:
        _swap(self, staged)


reload.WeightFollower._swap = _skipping

if __name__ == "__main__":
    from rollflash.rollctl.cli import main

    sys.argv = ["rollctl", *sys.argv[1:]]
    main()
