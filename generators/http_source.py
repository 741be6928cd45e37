"""A generator's weight versions over HTTP (`weights.transport: http`).

The version is fetched into this generator's own store, `{local_dir}/{id}/weights`
(broker/weights/weight_client.py), which keeps the last `trainer.keep_versions` versions and the loaded
one, as the learner's store does; with `weights.relay` this generator serves what it fetches to
other generators as it verifies it (broker/weights/weight_server.py). A version is fetched in one form: a
full version's model file, an adapter's files, or a delta (broker/weights/manifest.py); the learner names
a source per version and form, and a relay serves the form it fetched. An engine that loads from a
path loads the file in that store, or, with deltas, the full file the plan rebuilt
(generators/held.py). Before each fetch it writes, with its own Redis credentials, the key that
proves to the learner's server that its requests for a source are its own, and its relay's URL
(broker/weights/weight_auth.py); so nobody else with the run's weights token can ask as it, or point other
generators at an address it did not write.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollflash.broker.config.config import Config, ConfigError
from rollflash.broker.config.config_weights import server_limits, split_listen
from rollflash.broker.connect.secrets import url_ca_certs, weights_token
from rollflash.broker.weights.manifest import DELTA_FILE, MANIFEST, MODEL_FILE, Manifest
from rollflash.broker.weights.weight_auth import credential_fields, new_key
from rollflash.broker.weights.weight_client import Fetched, WeightClient, client_context
from rollflash.broker.weights.weight_path import Step
from rollflash.broker.weights.weight_server import WeightServer, server_context
from rollflash.broker.weights.weight_stream import FileSink, Sink, TensorSink
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators.fetch import (
    Advertiser,
    Announced,
    Staged,
    by_plan,
    own_dir,
    staged_chain,
    takes_tensors,
)
from rollflash.generators.held import HeldCopy, size_text

log = logging.getLogger(__name__)


class HttpSource:
    """The learner's store over HTTP, into this generator's own store, relaying it on."""

    def __init__(
        self, cfg: Config, generator_id: str, broker: Advertiser, held: HeldCopy | None = None
    ):
        w = cfg.weights
        try:
            token = weights_token(w.token_file)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ca = w.ssl_ca_certs or url_ca_certs(cfg.redis.url)
        key = new_key()
        self.client = WeightClient(token, generator_id, key, client_context(ca))
        self.store = WeightStore(own_dir(cfg, generator_id))
        self.store.clean_temp()
        self.keep, self.held = cfg.trainer.keep_versions, held
        self.server = None
        if w.relay:
            host, port = split_listen(w.listen)
            context = server_context(w.ssl_certfile, w.ssl_keyfile)
            self.server = WeightServer(token, host, port, context, limits=server_limits(w))
            log.info("relaying weight versions at %s", self.server.start())
        relay = self.server.url if self.server is not None else None
        self._credential = credential_fields(key, relay)
        self._broker = broker
        self._in_use: set[int] = set()

    def register(self) -> None:
        """Write this generator's weights key and relay URL in its status hash (broker/
        weight_auth.py): the learner's server then names it a source, and sends others to it."""
        self._broker.advertise(self._credential)

    def fetch(self, announced: Announced, engine: Any, in_use: set[int]) -> Staged:
        v, url = announced.version, announced.http_url
        if not url:
            raise ConnectionError(f"weights v{v}: the weights hash names no http_url")
        self._in_use = set(in_use)
        reader = _Reader(self, url)
        top = reader.manifest(v, announced.sha256)
        if top is not None and by_plan(self.held, top):
            assert self.held is not None
            staged = staged_chain(self.held, reader, announced, engine)
            staged.source = f"{staged.source}: {_sources(reader.received, reader.failed)}"
            return staged
        tensors: TensorSink | None = None

        def sinks(manifest: Manifest) -> list[Sink]:
            nonlocal tensors
            if manifest.kind == "full" and takes_tensors(engine):
                tensors = TensorSink(engine.new_weights)
                return [tensors]
            return []

        kind = top.kind if top is not None else "full"
        got = self.fetch_form(url, v, announced.sha256, kind, sinks)
        path = self.store.version_dir(v)
        return Staged(
            v,
            got.manifest.kind,
            tensors=tensors.result() if tensors is not None else None,
            path=path / MODEL_FILE if got.manifest.kind == "full" else path,
            source=_sources(got.received, got.failed),
            fetched=sum(got.received.values()),
        )

    def fetch_form(
        self,
        url: str,
        v: int,
        sha256: str | None,
        form: str,
        extra: Callable[[Manifest], list[Sink]],
    ) -> Fetched:
        """Fetch `form` of version `v` into this generator's store (and `extra(manifest)`'s
        sinks), relaying it as it is verified; applies the store's retention."""
        tmp = self.store.root / f".tmp-v{v:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        files = FileSink(tmp)
        holding = None

        def relay(manifest: Manifest) -> Callable[[str, int], None] | None:
            nonlocal holding
            if self.server is None:
                return None
            holding = self.server.hold(manifest, files.fds)
            return holding.mark

        self.register()  # renewed per fetch: the status hash expires
        if self.server is not None:
            self.server.expect(v)
        try:
            relay_url = self.server.url if self.server is not None else None
            got = self.client.fetch(
                url, v, sha256, lambda m: [files, *extra(m)], relay_url, relay, form=form
            )
            (tmp / MANIFEST).write_bytes(got.manifest.raw)
            shutil.rmtree(self.store.version_dir(v), ignore_errors=True)  # an older fetch of it
            os.rename(tmp, self.store.version_dir(v))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.server is not None:
                self.server.forget([v])
            raise
        if holding is not None:
            holding.finish(True)
        doomed = self.store.retain(self.keep, in_use=self._in_use | {v})
        if self.server is not None:
            self.server.forget(doomed)
        return got

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class _Reader:
    """The learner's store over HTTP as a `ChainReader` (broker/weights/weight_chain.py): manifests from
    the learner, every file through this generator's store and relay."""

    def __init__(self, source: HttpSource, url: str):
        self.source, self.url = source, url
        self.received: Counter[str] = Counter()  # source URL -> bytes, over the plan's steps
        self.failed: list[str] = []

    def manifest(self, version: int, sha256: str | None) -> Manifest | None:
        return self.source.client.manifest(self.url, version, sha256)

    def read_full(self, step: Step, sinks: list[Sink]) -> None:
        self._count(
            self.source.fetch_form(
                self.url, step.version, step.manifest.digest, step.form, lambda m: sinks
            )
        )

    @contextmanager
    def delta_file(self, step: Step, scratch: Path) -> Iterator[Path]:
        self._count(
            self.source.fetch_form(
                self.url, step.version, step.manifest.digest, "delta", lambda m: []
            )
        )
        yield self.source.store.version_dir(step.version) / DELTA_FILE

    def _count(self, got: Fetched) -> None:
        self.received.update(got.received)
        self.failed += [u for u in got.failed if u not in self.failed]


def _sources(received: Counter[str], failed: list[str]) -> str:
    """Where a version's bytes came from, for the log: "1.0 GiB from http://..."."""
    return ", ".join(f"{size_text(n)} from {url}" for url, n in received.items()) + (
        f"; failed over from {', '.join(failed)}" if failed else ""
    )
