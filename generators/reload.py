"""Picking up new weight versions in a generator.

The `weights` hash in Redis is the source of truth; zmq notifications only wake us sooner. A version
is loaded only after `WeightStore.verified_path` has checked it against its manifest; a version that
fails the check (or was already deleted by retention) is skipped with a warning and the generator
keeps its current weights until a newer version verifies.
"""

from __future__ import annotations

import logging
import time

from rollflash.broker.generator_side import GeneratorBroker
from rollflash.broker.notify import VersionSubscriber
from rollflash.broker.weights import CorruptWeights, WeightStore
from rollflash.generators.engine import Engine

log = logging.getLogger(__name__)


class WeightFollower:
    def __init__(
        self,
        broker: GeneratorBroker,
        store: WeightStore,
        engine: Engine,
        poll_interval_s: float = 2.0,
    ):
        self.broker, self.store, self.engine = broker, store, engine
        self.poll_interval_s = poll_interval_s
        self.loaded_version = 0  # v0 is the model at model.path, which the engine started from
        self.reloads = 0
        self.reload_s = 0.0
        self._sub: VersionSubscriber | None = None
        self._last_poll = 0.0
        self._announced = 0

    def _published(self) -> tuple[int, str | None]:
        info = self.broker.weights()
        endpoint = info.get("zmq_endpoint")
        if endpoint and (self._sub is None or self._sub.endpoint != endpoint):
            if self._sub is not None:
                self._sub.close()
            self._sub = VersionSubscriber(endpoint)
        version = info.get("version")
        return (int(version), info.get("sha256")) if version is not None else (0, None)

    def newest(self, wait_s: float = 0.0) -> tuple[int, str | None]:
        """Newest published version (and its sha256), reading the hash at most every poll interval
        unless a notification arrived; waits up to `wait_s` for a notification."""
        notified = self._sub.latest(int(wait_s * 1000)) if self._sub is not None else None
        if notified is not None:
            self._announced = max(self._announced, notified)
        now = time.monotonic()
        if self._announced > self.loaded_version or now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now
            return self._published()
        return self.loaded_version, None

    def maybe_reload(self, wait_s: float = 0.0) -> bool:
        """Load the newest verified version if it is newer than the loaded one."""
        version, sha = self.newest(wait_s)
        if version <= self.loaded_version:
            return False
        started = time.monotonic()
        try:
            path = self.store.verified_path(version, expect_sha256=sha)
            self.engine.load_weights(path, version)
        except (CorruptWeights, FileNotFoundError) as e:
            log.warning("not loading weights v%d: %s", version, e)
            return False
        self.reload_s += time.monotonic() - started
        self.reloads += 1
        self.loaded_version = version
        log.info("loaded weights v%d in %.2fs", version, time.monotonic() - started)
        return True

    def wait_for(self, version: int, timeout_s: float) -> None:
        """Block until at least `version` is loaded (synchronous mode needs it)."""
        deadline = time.monotonic() + timeout_s
        while self.loaded_version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights v{version} were not published within {timeout_s}s")
            self._last_poll = 0.0  # force a hash read: we know a newer version is due
            if not self.maybe_reload(wait_s=0.5):
                time.sleep(0.05)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()
