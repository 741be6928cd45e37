"""Picking up new weight versions in a generator, off the sampling path.

A thread of its own follows the published versions: the `weights` hash in Redis is the source of
truth, zmq notifications only wake it sooner. When a version newer than the loaded one is
announced, the thread fetches and verifies it (generators/fetch.py: from the shared store or over
HTTP, every chunk checked against the manifest that the announced digest authenticates) into
what the engine swaps in: tensors the engine allocated on its device, or a verified private file
for an engine that loads from a path. Meanwhile the engine keeps sampling. The rollout loop calls
`maybe_reload` between batches (or decode steps); the only pause is the swap itself
(`engine.swap_weights`, or `load_weights` / `load_adapter` from the verified path). One version
waits staged at a time; once it is swapped in, the thread looks for the next.

A version that fails (fetch, verification, or the engine's check or load) is tried again with
backoff (broker/retry.py `backoff_delay`), `weights.reload_attempts` times in all, then refused:
logged, counted (`reload_refused`, shown by `rollctl status`) and skipped; the generator keeps
its current weights until a newer version loads, and never stops over it. The engines check names
and shapes before they touch a weight, so a refused version leaves the old weights whole.
Per version the generator reports how long the fetch took and how long sampling paused
(`reload_fetch_s`, `reload_pause_s` in its heartbeat; the learner logs them as `gen/...`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollflash.broker.manifest import CorruptWeights
from rollflash.broker.notify import VersionSubscriber
from rollflash.broker.retry import backoff_delay
from rollflash.generators.fetch import Announced

if TYPE_CHECKING:
    from rollflash.generators.fetch import Staged, VersionSource

log = logging.getLogger(__name__)

WAKE_S = 0.1  # how often the thread looks at notifications and requests
WAIT_BEAT_S = 1.0  # how often `wait_for` heartbeats while a generator waits for weights


class WeightFollower:
    def __init__(
        self,
        broker: Any,
        source: VersionSource,
        engine: Any,
        poll_interval_s: float = 2.0,
        attempts: int = 3,
    ):
        """`broker` answers `weights()` (the `weights` hash); `source` stages a version."""
        self.broker, self.source, self.engine = broker, source, engine
        self.poll_interval_s, self.attempts = poll_interval_s, attempts
        self.loaded_version = 0  # v0 is the model at model.path, which the engine started from
        self.reloads = 0
        self.reload_refused = 0  # versions skipped after every attempt failed
        self.reload_retries = 0  # failed attempts that were tried again
        self.reload_fetch_s = 0.0  # the last version loaded: fetch and verification
        self.reload_pause_s = 0.0  # ... and the swap, the only time sampling waited
        self._lock = threading.Condition()
        self._staged: Staged | None = None
        self._tries: dict[int, int] = {}
        self._skipped = 0  # the newest version given up on
        self._retry_at = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="weights", daemon=True)
        self._thread.start()

    # --- the rollout loop's thread ------------------------------------------------------------
    def maybe_reload(self, wait_s: float = 0.0) -> bool:
        """Swap in the staged version if there is one (waiting up to `wait_s` for it)."""
        with self._lock:
            if self._staged is None and wait_s > 0:
                self._lock.wait(wait_s)
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        started = time.monotonic()
        try:
            self._swap(staged)
        except Exception as e:  # noqa: BLE001 - any refusal keeps the current weights
            self._failed(staged.version, e)
            return False
        finally:
            staged.discard()
            self._wake.set()  # look for the next version now
        self.reload_pause_s = time.monotonic() - started
        self.reload_fetch_s = staged.fetch_s
        self.reloads += 1
        self.loaded_version = staged.version
        log.info(
            "loaded weights v%d: fetched and verified in %.2fs (%s), sampling paused %.3fs",
            staged.version,
            staged.fetch_s,
            staged.source,
            self.reload_pause_s,
        )
        return True

    def _swap(self, staged: Staged) -> None:
        """Hand the verified version to the engine: full weights as tensors or a file, or a LoRA
        adapter directory on top of the engine's base model (engines with `load_adapter`)."""
        if staged.kind == "full":
            if staged.tensors is not None:
                self.engine.swap_weights(staged.tensors, staged.version)
            else:
                self.engine.load_weights(staged.path, staged.version)
            return
        load_adapter = getattr(self.engine, "load_adapter", None)
        if load_adapter is None:
            raise NotImplementedError(
                f"the {type(self.engine).__name__} engine cannot load adapter versions; "
                "publish full versions (trainer.publish: full)"
            )
        load_adapter(staged.path, staged.version)

    def wait_for(
        self,
        version: int,
        timeout_s: float,
        run_alive: Callable[[], object] | None = None,
        beat: Callable[[], object] | None = None,
    ) -> None:
        """Block until at least `version` is loaded (synchronous mode needs it). `run_alive` is
        called between looks (the generator's `run_state`): it raises when the run is gone, so a
        generator whose Redis came back empty stops with that error, not a timeout. `beat` (the
        generator's heartbeat) runs every WAIT_BEAT_S meanwhile: a generator waiting for weights
        is alive, and its heartbeat must not expire however long the learner's step takes."""
        deadline = time.monotonic() + timeout_s
        next_beat = time.monotonic() + WAIT_BEAT_S  # its caller beat just before
        while self.loaded_version < version:
            if run_alive is not None:
                run_alive()
            if beat is not None and time.monotonic() >= next_beat:
                beat()
                next_beat = time.monotonic() + WAIT_BEAT_S
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights v{version} were not published within {timeout_s}s")
            self._wake.set()  # read the hash now: we know a newer version is due
            self.maybe_reload(wait_s=0.5)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            staged.discard()
        self.source.close()

    # --- the follower's thread ----------------------------------------------------------------
    def _follow(self) -> None:
        sub: VersionSubscriber | None = None
        notified_max, last_poll = 0, 0.0
        while not self._stop.is_set():
            try:
                notified = sub.latest(int(WAKE_S * 1000)) if sub is not None else None
                if sub is None:
                    self._wake.wait(WAKE_S)
                woken = self._wake.is_set()
                self._wake.clear()
                notified_max = max(notified_max, notified or 0)
                now = time.monotonic()
                due = now - last_poll >= self.poll_interval_s
                if woken or due or self._wanted(notified_max):
                    last_poll = now
                    published, sub = self._published(sub)
                    if self._wanted(published.version):
                        self._stage(published)
            except Exception as e:  # noqa: BLE001 - Redis trouble: the rollout loop waits it out
                log.warning("reading the weights hash failed (%s); trying again", e)
                self._stop.wait(1.0)
        if sub is not None:
            sub.close()

    def _published(self, sub: VersionSubscriber | None) -> tuple[Announced, Any]:
        info = self.broker.weights()
        endpoint = info.get("zmq_endpoint")
        if endpoint and (sub is None or sub.endpoint != endpoint):
            if sub is not None:
                sub.close()
            sub = VersionSubscriber(endpoint)
        version = info.get("version")
        if version is None:
            return Announced(0, None), sub
        return Announced(int(version), info.get("sha256"), info.get("http_url")), sub

    def _wanted(self, version: int) -> bool:
        with self._lock:
            waiting = self._staged is not None
        return (
            not waiting
            and version > max(self.loaded_version, self._skipped)
            and time.monotonic() >= self._retry_at
        )

    def _stage(self, announced: Announced) -> None:
        started = time.monotonic()
        try:
            staged = self.source.fetch(announced, self.engine, {self.loaded_version})
        except Exception as e:  # noqa: BLE001 - counted, tried again or refused
            self._failed(announced.version, e)
            return
        staged.fetch_s = time.monotonic() - started
        with self._lock:
            self._staged = staged
            self._lock.notify_all()

    def _failed(self, version: int, e: Exception) -> None:
        """One failed attempt at `version`: try again after a backoff, or refuse it."""
        kind = "failed verification" if isinstance(e, CorruptWeights) else "failed to load"
        reason = f"{kind}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        with self._lock:
            tries = self._tries[version] = self._tries.get(version, 0) + 1
            self._tries = {v: n for v, n in self._tries.items() if v >= version}
        if tries < self.attempts:
            self.reload_retries += 1
            delay = backoff_delay(tries)
            self._retry_at = time.monotonic() + delay
            log.warning(
                "weights v%d: attempt %d of %d %s; trying again in %.1fs",
                version,
                tries,
                self.attempts,
                reason,
                delay,
            )
            return
        self.reload_refused += 1
        self._skipped = max(self._skipped, version)
        log.error("refused weights v%d (%s); keeping v%d", version, reason, self.loaded_version)
