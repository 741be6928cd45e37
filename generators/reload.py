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
backoff (broker/connect/retry.py `backoff_delay`), `weights.reload_attempts` times in all, then refused:
logged, counted (`reload_refused`, shown by `rollctl status`) and skipped; the generator keeps
its current weights until a newer version loads, and never stops over it. The engines check names
and shapes before they touch a weight, so a refused version leaves the old weights whole.
Per version the generator reports how long the fetch took and how long sampling paused
(`reload_fetch_s`, `reload_pause_s` in its heartbeat; the learner logs them as `gen/...`).

Proof of serving (broker/weights/probe.py): once a version is swapped in, an engine that can (`probe`:
hf, vllm) computes the probe of the run with the weights it now serves, and the generator
reports it in its heartbeat (`probe_fields`), for the learner to check. The probe runs when the
engine is idle (`busy`: no request in flight), right after the swap between batches, or at the
next idle moment when the swap came mid-batch (`rollout.interrupt`); its time is not part of the
pause (`reload_probe_s`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollflash.broker.config.config import Config
from rollflash.broker.connect.retry import backoff_delay
from rollflash.broker.weights.manifest import CorruptWeights
from rollflash.broker.weights.notify import VersionSubscriber
from rollflash.broker.weights.probe import Report, probe_fields, probe_ids
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators.fetch import (
    Advertiser,
    Announced,
    SharedStoreSource,
    VersionSource,
    own_dir,
)
from rollflash.generators.held import HeldCopy

if TYPE_CHECKING:
    from rollflash.generators.fetch import Staged

log = logging.getLogger(__name__)

WAKE_S = 0.1  # how often the thread looks at notifications and requests
WAIT_BEAT_S = 1.0  # how often `wait_for` heartbeats while a generator waits for weights


def version_source(cfg: Config, generator_id: str, broker: Advertiser) -> VersionSource:
    """Where this generator's `WeightFollower` fetches versions from (`weights.transport`):
    the learner's store on the shared filesystem, or over HTTP. `broker`: this generator's (it
    registers the generator's weights key, `HttpSource`)."""
    held = HeldCopy(own_dir(cfg, generator_id) / "held", eager=cfg.weights.anchor_every > 1)
    if cfg.weights.transport == "http":
        from rollflash.generators.http_source import HttpSource  # its HTTP stack only when used

        return HttpSource(cfg, generator_id, broker, held)
    copies = own_dir(cfg, generator_id) / "copies"
    return SharedStoreSource(WeightStore(cfg.run.run_dir), copies, held)


class WeightFollower:
    def __init__(
        self,
        broker: Any,
        source: VersionSource,
        engine: Any,
        poll_interval_s: float = 2.0,
        attempts: int = 3,
        run_id: str | None = None,
    ):
        """`broker` answers `weights()` (the `weights` hash); `source` stages a version;
        `run_id`: the run whose probe the engine computes after each load (None: none)."""
        self.broker, self.source, self.engine = broker, source, engine
        self._probe_ids = None
        if run_id is not None and hasattr(engine, "probe"):
            self._probe_ids = probe_ids(run_id, engine.vocab_size)
        self._probe_due = False
        self.probe_fields: dict[str, str] = {}  # the last probe, for the heartbeat
        self._probed: Report | None = None  # ... as a report: the next one's `before`
        self.reload_probe_s = 0.0
        self.poll_interval_s, self.attempts = poll_interval_s, attempts
        self.loaded_version = 0  # v0 is the model at model.path, which the engine started from
        self.reloads = 0
        self.reload_refused = 0  # versions skipped after every attempt failed
        self.reload_retries = 0  # failed attempts that were tried again
        self.reload_fetch_s = 0.0  # the last version loaded: fetch and verification
        self.reload_pause_s = 0.0  # ... and the swap, the only time sampling waited
        self.reload_bytes = 0  # ... and the bytes of the files read for it (a delta: its own)
        self._lock = threading.Condition()
        self._staged: Staged | None = None
        self._tries: dict[int, int] = {}
        self._skipped = 0  # the newest version given up on
        self._swapping = 0  # the version the rollout loop is swapping in (0: none)
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
            # until it is loaded or failed, the follower must not stage it a second time
            self._swapping = staged.version if staged is not None else 0
        if staged is None:
            self._take_probe()  # one that waited for the engine to be idle
            return False
        started = time.monotonic()
        try:
            self._swap(staged)
        except Exception as e:  # noqa: BLE001 - any refusal keeps the current weights
            staged.discard()
            self._failed(staged.version, e)
            self._swapped()
            return False
        self.reload_pause_s = time.monotonic() - started
        staged.loaded()  # after the pause: it only drops the previous held file
        staged.discard()
        self.reload_fetch_s = staged.fetch_s
        self.reload_bytes = staged.fetched
        self.reloads += 1
        self.loaded_version = staged.version
        self._swapped()
        log.info(
            "loaded weights v%d: fetched and verified in %.2fs (%s), sampling paused %.3fs",
            staged.version,
            staged.fetch_s,
            staged.source,
            self.reload_pause_s,
        )
        self._probe_due = self._probe_ids is not None
        self._take_probe()
        return True

    def heartbeat_fields(self) -> dict[str, int | float | str]:
        """What the generator's heartbeat says of its weights: the loaded version, reloads,
        refusals, the last version's fetch, pause and bytes, and its probe."""
        return {
            "loaded_version": self.loaded_version,
            "reloads": self.reloads,
            "reload_refused": self.reload_refused,
            "reload_retries": self.reload_retries,
            "reload_fetch_s": round(self.reload_fetch_s, 3),
            "reload_pause_s": round(self.reload_pause_s, 4),
            "reload_bytes": self.reload_bytes,
            "reload_probe_s": round(self.reload_probe_s, 4),
            **self.probe_fields,
        }

    def _take_probe(self) -> None:
        """The probe of the loaded version, once the engine is idle (module docstring)."""
        busy = getattr(self.engine, "busy", None)
        if not self._probe_due or self._probe_ids is None or (busy is not None and busy()):
            return
        self._probe_due = False
        started = time.monotonic()
        try:
            values = self.engine.probe(self._probe_ids)
        except Exception as e:  # noqa: BLE001 - no report: the learner judges nothing
            log.warning("weights v%d: the probe failed (%s)", self.loaded_version, e)
            return
        self.reload_probe_s = time.monotonic() - started
        before = (
            self._probed if self._probed and self._probed.version < self.loaded_version else None
        )
        dtype = self.engine.compute_dtype
        self._probed = Report(self.loaded_version, tuple(values), dtype)
        self.probe_fields = probe_fields(self.loaded_version, values, dtype, before)
        advertise = getattr(self.broker, "advertise", None)  # now, not at the next heartbeat
        if advertise is not None:
            advertise(self.probe_fields)

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

    def _swapped(self) -> None:
        """The swap is over (loaded or failed): look for the next version now."""
        with self._lock:
            self._swapping = 0
        self._wake.set()

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
            waiting, swapping = self._staged is not None, self._swapping
        return (
            not waiting
            and version > max(self.loaded_version, self._skipped, swapping)
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
