"""The verified full file of the version a generator has loaded, kept for the next delta.

With `weights.anchor_every` > 1 the learner publishes most versions as deltas against the version
before (broker/weights/delta_write.py). A generator then keeps, in `{weights.local_dir}/{id}/held/`, the
full file of the version its engine loaded (written while it was verified: a full read, or a
delta applied and checked tensor by tensor), and reads each new version along the cheapest plan
from it (broker/weights/weight_path.py): the delta alone when it holds the version before, after a gap the
deltas since or an anchor and the deltas after it, whichever is fewer bytes. A delta that fails
its check is left out and the plan is made again, so the generator falls back to a full version
(an anchor) below it; nothing of the failed step reaches the engine. The held file changes only
once the engine has loaded the new version (`adopt`); until then the old one stays, so a version
the engine refuses leaves the generator able to apply the next delta to what it serves.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from rollflash.broker.weights.manifest import MODEL_FILE
from rollflash.broker.weights.weight_chain import ChainReader, StepFailed, rebuild
from rollflash.broker.weights.weight_path import Held, Step, plan
from rollflash.broker.weights.weight_stream import Sink

log = logging.getLogger(__name__)


class HeldCopy:
    """`eager`: hold every full version from the first (the run publishes deltas:
    `weights.anchor_every` > 1), not only once a version with a delta has been seen."""

    def __init__(self, directory: Path, eager: bool = True):
        shutil.rmtree(directory, ignore_errors=True)  # an earlier process's: never trusted
        directory.mkdir(mode=0o700)
        self.dir, self.eager = directory, eager
        self.held: Held | None = None
        self._held_dir: Path | None = None
        self.refused = 0  # deltas that failed their check (then read another way)

    def fetch(
        self, reader: ChainReader, version: int, sha256: str | None, sinks: Callable[[], list[Sink]]
    ) -> tuple[Path, list[Step]]:
        """Read `version` along the cheapest plan, its bytes into `sinks()` (made anew for each
        attempt); returns the directory of its full file (`adopt` or `discard` it) and the plan
        followed."""
        refused: set[tuple[int, str]] = set()
        while True:
            steps = plan(reader.manifest, version, sha256, self.held, refused)
            base = self._held_dir / MODEL_FILE if self._held_dir is not None else None
            try:
                return rebuild(reader, steps, base, self.dir, sinks()), steps
            except StepFailed as e:
                if e.step.form != "delta":
                    raise
                refused.add((e.step.version, "delta"))
                self.refused += 1
                log.warning(
                    "weights v%d: its delta failed its check (%s); reading it another way",
                    e.step.version,
                    str(e).splitlines()[0][:300],
                )

    def adopt(self, version: int, sha256: str, directory: Path) -> None:
        """The engine loaded `version` from the full file in `directory`: hold that one."""
        if self._held_dir is not None and self._held_dir != directory:
            shutil.rmtree(self._held_dir, ignore_errors=True)
        self.held, self._held_dir = Held(version, sha256), directory

    def discard(self, directory: Path) -> None:
        """A fetched version that is not held (not loaded, or replaced)."""
        if directory != self._held_dir:
            shutil.rmtree(directory, ignore_errors=True)


def describe(steps: list[Step]) -> str:
    """The plan followed, for the log: "v30 full 1.0 GiB + 7 deltas 20.1 MiB"."""
    fulls = [s for s in steps if s.form != "delta"]
    deltas = [s for s in steps if s.form == "delta"]
    parts = [f"v{s.version} {s.form} {size_text(s.size)}" for s in fulls]
    if deltas:
        total = size_text(sum(s.size for s in deltas))
        parts.append(f"{len(deltas)} delta{'s' * (len(deltas) > 1)} {total}")
    return " + ".join(parts)


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
