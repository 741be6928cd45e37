"""Where a generator gets a weight version from, and what it stages for its engine.

A `VersionSource` fetches and verifies one announced version (in the reload thread,
generators/reload.py) and returns it `Staged` in the form the engine swaps in:
- an engine with `new_weights` / `swap_weights` (hf, sim) gets the version's tensors, filled
  chunk by chunk as each chunk is verified, on the engine's device: nothing lands on disk, and
  the host holds only the few chunk buffers of the read (broker/weight_stream.py);
- an engine that loads from a path (vllm's `load_weights`, every `load_adapter`) gets a file
  written while it was verified (one read, one write) in a directory this generator owns.

`weights.transport: shared_fs` (`SharedStoreSource`): the learner's store in `run.run_dir`,
opened without following links; a private copy goes to `{local_dir}/{id}/copies` and is removed
once swapped in. `weights.transport: http` (`HttpSource`): the version is fetched into this
generator's own store, `{local_dir}/{id}/weights` (broker/weight_client.py), which keeps the last
`trainer.keep_versions` versions and the loaded one, as the learner's store does; with
`weights.relay` this generator serves what it fetches to other generators as it verifies it
(broker/weight_server.py). An engine that loads from a path loads the file in that store.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rollflash.broker.config import Config, ConfigError
from rollflash.broker.config_weights import split_listen
from rollflash.broker.manifest import MANIFEST, MODEL_FILE, Manifest
from rollflash.broker.secrets import make_private_dir, url_ca_certs, weights_token
from rollflash.broker.weight_stream import FileSink, Sink, TensorSink, copy_verified, read_version
from rollflash.broker.weights import WeightStore

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A verified version, ready to swap in: `tensors`, or the `path` of a file or adapter."""

    version: int
    kind: str
    tensors: dict[str, torch.Tensor] | None = None
    path: Path | None = None
    source: str = ""  # where it came from, for the log
    fetch_s: float = 0.0
    discard: Callable[[], None] = field(default=lambda: None)  # after the swap (or instead)


@dataclass(frozen=True)
class Announced:
    """A version as the `weights` hash announces it."""

    version: int
    sha256: str | None
    http_url: str | None = None


class VersionSource(Protocol):
    def fetch(self, announced: Announced, engine: Any, in_use: set[int]) -> Staged:
        """Fetch and verify a version; `in_use`: versions retention must keep (the loaded one)."""

    def close(self) -> None: ...


def takes_tensors(engine: Any) -> bool:
    return hasattr(engine, "new_weights") and hasattr(engine, "swap_weights")


def own_dir(cfg: Config, generator_id: str) -> Path:
    """This generator's own directory (`weights.local_dir`), mode 0700."""
    if "/" in generator_id or generator_id in ("", ".", ".."):
        raise ConfigError(f"--id: {generator_id!r} cannot name a directory; use letters, digits, -")
    path = Path(cfg.weights.local_dir or Path(cfg.run.run_dir) / "local") / generator_id
    make_private_dir(path)
    return path


def version_source(cfg: Config, generator_id: str) -> VersionSource:
    if cfg.weights.transport == "http":
        return HttpSource(cfg, generator_id)
    return SharedStoreSource(WeightStore(cfg.run.run_dir), own_dir(cfg, generator_id) / "copies")


class SharedStoreSource:
    """The learner's store on a filesystem this host shares."""

    def __init__(self, store: WeightStore, copies: Path):
        self.store, self.copies = store, copies

    def fetch(self, announced: Announced, engine: Any, in_use: set[int]) -> Staged:
        v = announced.version
        opened = self.store.open_version(v, announced.sha256)
        try:
            if opened.manifest.kind == "full" and takes_tensors(engine):
                sink = TensorSink(engine.new_weights)
                read_version(opened.manifest, opened.fds, [sink])
                return Staged(v, "full", tensors=sink.result(), source="shared store")
        finally:
            opened.close()
        self.copies.mkdir(mode=0o700, exist_ok=True)
        dest = self.copies / f"v{v:08d}"
        shutil.rmtree(dest, ignore_errors=True)  # left by a failed attempt
        kind = copy_verified(self.store, v, dest, announced.sha256).kind
        return Staged(
            v,
            kind,
            path=dest / MODEL_FILE if kind == "full" else dest,
            source="shared store, private copy",
            discard=lambda: shutil.rmtree(dest, ignore_errors=True),
        )

    def close(self) -> None:
        shutil.rmtree(self.copies, ignore_errors=True)


class HttpSource:
    """The learner's store over HTTP, into this generator's own store, relaying it on."""

    def __init__(self, cfg: Config, generator_id: str):
        from rollflash.broker.weight_client import WeightClient, client_context
        from rollflash.broker.weight_server import WeightServer, server_context

        w = cfg.weights
        try:
            token = weights_token(w.token_file)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ca = w.ssl_ca_certs or url_ca_certs(cfg.redis.url)
        self.client = WeightClient(token, generator_id, client_context(ca))
        self.store = WeightStore(own_dir(cfg, generator_id))
        self.store.clean_temp()
        self.keep = cfg.trainer.keep_versions
        self.server = None
        if w.relay:
            host, port = split_listen(w.listen)
            self.server = WeightServer(
                token, host, port, server_context(w.ssl_certfile, w.ssl_keyfile)
            )
            log.info("relaying weight versions at %s", self.server.start())

    def fetch(self, announced: Announced, engine: Any, in_use: set[int]) -> Staged:
        v = announced.version
        if not announced.http_url:
            raise ConnectionError(f"weights v{v}: the weights hash names no http_url")
        tmp = self.store.root / f".tmp-v{v:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        files, tensors = FileSink(tmp), None

        def sinks(manifest: Manifest) -> list[Sink]:
            nonlocal tensors
            if manifest.kind == "full" and takes_tensors(engine):
                tensors = TensorSink(engine.new_weights)
                return [files, tensors]
            return [files]

        holding = None

        def relay(manifest: Manifest) -> Callable[[str, int], None] | None:
            nonlocal holding
            if self.server is None:
                return None
            holding = self.server.hold(manifest, files.fds)
            return holding.mark

        if self.server is not None:
            self.server.expect(v)
        try:
            relay_url = self.server.url if self.server is not None else None
            got = self.client.fetch(
                announced.http_url, v, announced.sha256, sinks, relay_url, relay
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
        doomed = self.store.retain(self.keep, in_use=in_use | {v})
        if self.server is not None:
            self.server.forget(doomed)
        path = self.store.version_dir(v)
        return Staged(
            v,
            got.manifest.kind,
            tensors=tensors.result() if tensors is not None else None,
            path=path / MODEL_FILE if got.manifest.kind == "full" else path,
            source=", ".join(f"{_size(n)} from {url}" for url, n in got.received.items())
            + (f"; failed over from {', '.join(got.failed)}" if got.failed else ""),
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
