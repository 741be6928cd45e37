"""Where a generator gets a weight version from, and what it stages for its engine.

A `VersionSource` fetches and verifies one announced version (in the reload thread,
generators/reload.py) and returns it `Staged` in the form the engine swaps in:
- an engine with `new_weights` / `swap_weights` (hf, sim) gets the version's tensors, filled
  chunk by chunk as each chunk is verified, on the engine's device: nothing lands on disk, and
  the host holds only the few chunk buffers of the read (broker/weights/weight_stream.py);
- an engine that loads from a path (vllm's `load_weights`, every `load_adapter`) gets a file
  written while it was verified (one read, one write) in a directory this generator owns.

`weights.transport: shared_fs` (`SharedStoreSource`): the learner's store in `run.run_dir`,
opened without following links; a private copy goes to `{local_dir}/{id}/copies` and is removed
once swapped in. `weights.transport: http` (`HttpSource`, generators/http_source.py): the version
is fetched into this generator's own store and relayed on. generators/reload.py `version_source`
picks one.

When the learner publishes deltas (`weights.anchor_every` > 1, or once a version with a delta is
seen), every full version is read along the cheapest plan from the version the generator holds
(generators/held.py): both sources are `ChainReader`s (broker/weights/weight_chain.py), and the staged
version's full file becomes the held one once the engine has loaded it (`Staged.loaded`).
Otherwise, and for adapter versions (LoRA), a version is read whole, and nothing is held.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rollflash.broker.config.config import Config, ConfigError
from rollflash.broker.connect.secrets import private_subdir
from rollflash.broker.weights.manifest import MODEL_FILE, Manifest
from rollflash.broker.weights.weight_chain import ChainReader, StoreReader
from rollflash.broker.weights.weight_path import path_bytes
from rollflash.broker.weights.weight_stream import Sink, TensorSink, copy_verified, read_version
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators.held import HeldCopy, describe

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
    fetched: int = 0  # bytes of the version's files read (or received) for it
    discard: Callable[[], None] = field(default=lambda: None)  # after the swap (or instead)
    loaded: Callable[[], None] = field(default=lambda: None)  # once the engine swapped it in


@dataclass(frozen=True)
class Announced:
    """A version as the `weights` hash announces it."""

    version: int
    sha256: str | None
    http_url: str | None = None


class Advertiser(Protocol):
    def advertise(self, fields: dict[str, str]) -> None:
        """Write `fields` in this generator's status hash (GeneratorBroker.advertise)."""


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
    return private_subdir(path)


def by_plan(held: HeldCopy | None, manifest: Manifest) -> bool:
    """Whether to read a version along a plan: the run publishes deltas (as its config says,
    or as this version, or one read before, shows)."""
    return (
        held is not None
        and manifest.kind != "adapter"
        and (held.eager or manifest.delta is not None or held.held is not None)
    )


def staged_chain(held: HeldCopy, reader: ChainReader, announced: Announced, engine: Any) -> Staged:
    """Read a full version along the cheapest plan from what `held` holds (generators/held.py)
    into the engine's tensors, or its file for an engine that loads from a path."""
    tensors: TensorSink | None = None

    def sinks() -> list[Sink]:
        nonlocal tensors
        tensors = TensorSink(engine.new_weights) if takes_tensors(engine) else None
        return [tensors] if tensors is not None else []

    v = announced.version
    out, steps = held.fetch(reader, v, announced.sha256, sinks)
    digest = steps[-1].manifest.digest
    return Staged(
        v,
        "full",
        tensors=tensors.result() if tensors is not None else None,
        path=out / MODEL_FILE,
        source=describe(steps),
        fetched=path_bytes(steps),
        discard=lambda: held.discard(out),
        loaded=lambda: held.adopt(v, digest, out),
    )


class SharedStoreSource:
    """The learner's store on a filesystem this host shares; `held`: with deltas."""

    def __init__(self, store: WeightStore, copies: Path, held: HeldCopy | None = None):
        self.store, self.copies, self.held = store, copies, held

    def fetch(self, announced: Announced, engine: Any, in_use: set[int]) -> Staged:
        v = announced.version
        if by_plan(self.held, self.store.manifest(v, announced.sha256)):
            assert self.held is not None
            return staged_chain(self.held, StoreReader(self.store), announced, engine)
        opened = self.store.open_version(v, announced.sha256)
        try:
            if opened.manifest.kind == "full" and takes_tensors(engine):
                sink = TensorSink(engine.new_weights)
                read_version(opened.manifest, {MODEL_FILE: opened.fds[MODEL_FILE]}, [sink])
                size = opened.manifest.form_size("full")
                return Staged(v, "full", tensors=sink.result(), source="shared store", fetched=size)
        finally:
            opened.close()
        self.copies.mkdir(mode=0o700, exist_ok=True)
        dest = self.copies / f"v{v:08d}"
        shutil.rmtree(dest, ignore_errors=True)  # left by a failed attempt
        manifest = copy_verified(self.store, v, dest, announced.sha256)
        kind = manifest.kind
        return Staged(
            v,
            kind,
            path=dest / MODEL_FILE if kind == "full" else dest,
            source="shared store, private copy",
            fetched=manifest.form_size(kind),
            discard=lambda: shutil.rmtree(dest, ignore_errors=True),
        )

    def close(self) -> None:
        shutil.rmtree(self.copies, ignore_errors=True)
