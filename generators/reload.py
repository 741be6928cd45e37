"""Picking up new weight versions in a generator.

The `weights` hash in Redis is the source of truth; zmq notifications only wake us sooner. A version
is read from the store once (`WeightStore.verified_copy_dir`): its bytes are checked against the
manifest's digests (broker/digest.py) and the announced one, and written to a private directory
this process owns, and the engine loads that copy, so what is loaded is exactly what was hashed,
whatever happens to the shared store meanwhile. Links and anything outside the store are refused.

A version that fails the check (or was already deleted by retention), or that the engine cannot
load, is refused: logged, counted (`reload_refused`, shown by `rollctl status`), and skipped; the
generator keeps its current weights until a newer version loads, and never stops over it. The
engines check names and shapes before they touch a weight, so a refused version leaves the old
weights whole; an error in the middle of copying tensors (the engine itself failing) is counted
the same way, but then the engine's state is only as good as that engine's own error handling.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from rollflash.broker.generator_side import GeneratorBroker
from rollflash.broker.notify import VersionSubscriber
from rollflash.broker.weights import MODEL_FILE, CorruptWeights, WeightStore
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
        self.reload_refused = 0  # versions not loaded: failed verification or the engine's load
        self.reload_s = 0.0
        self._refused_version = 0  # a version refused once is not retried (nor counted again)
        self._private: Path | None = None  # mode 0700, made at the first reload
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
        if version <= max(self.loaded_version, self._refused_version):
            return False
        started = time.monotonic()
        if self._private is None:
            self._private = Path(tempfile.mkdtemp(prefix="rollflash-weights-"))
        copy = self._private / f"v{version:08d}"
        try:
            kind, _ = self.store.verified_copy_dir(version, copy, expect_sha256=sha)
            self._load(kind, copy, version)
        except Exception as e:  # noqa: BLE001 - any refusal keeps the current weights
            self.reload_refused += 1
            self._refused_version = version
            kind = "failed verification" if isinstance(e, CorruptWeights) else "failed to load"
            log.error(
                "refused weights v%d (%s: %s: %s); keeping v%d",
                version,
                kind,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                self.loaded_version,
            )
            return False
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        self.reload_s += time.monotonic() - started
        self.reloads += 1
        self.loaded_version = version
        log.info("loaded weights v%d in %.2fs", version, time.monotonic() - started)
        return True

    def _load(self, kind: str, copy: Path, version: int) -> None:
        """Hand the verified private copy to the engine: full weights, or a LoRA adapter on top
        of the engine's base model (engines that have `load_adapter`)."""
        if kind == "full":
            self.engine.load_weights(copy / MODEL_FILE, version)
            return
        load_adapter = getattr(self.engine, "load_adapter", None)
        if load_adapter is None:
            raise NotImplementedError(
                f"the {type(self.engine).__name__} engine cannot load adapter versions; "
                "publish full versions (trainer.publish: full)"
            )
        load_adapter(copy, version)

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
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
