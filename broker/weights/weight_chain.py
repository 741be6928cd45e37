"""Reading a version along a plan of full files and deltas (broker/weights/weight_path.py).

`rebuild` runs a plan step by step: a full step reads the version's full file, checked chunk by
chunk; a delta step applies the version's delta, checked chunk by chunk, to the full file the step
before produced (or the one the caller holds), and checks every tensor of the result
(broker/weights/delta_apply.py). Each step writes the version's full file into a new private directory,
the base of the next step; the last step's bytes also go to the caller's sinks (the engine's
tensors). A step that fails raises `StepFailed` naming it, so the caller can plan around it; what
the failed step wrote is removed and nothing reaches an engine.

A `ChainReader` is where the steps' bytes come from: `StoreReader`, a weight store on this
filesystem (the learner's, read by generators over `shared_fs`, by `rollctl export` and by
`eval.keep_best`), or a generator's HTTP fetcher (generators/http_source.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import torch

from rollflash.broker.weights.delta_apply import apply_delta
from rollflash.broker.weights.manifest import DELTA_FILE, MODEL_FILE, CorruptWeights, Manifest
from rollflash.broker.weights.weight_path import Held, Step, plan
from rollflash.broker.weights.weight_stream import (
    FileSink,
    Sink,
    TensorSink,
    full_tensors,
    host_tensors,
    read_version,
)
from rollflash.broker.weights.weights import WeightStore


class StepFailed(CorruptWeights):
    """A step of a plan whose bytes did not check out (its version and form are named)."""

    def __init__(self, step: Step, cause: BaseException):
        super().__init__(str(cause))
        self.step = step


class ChainReader(Protocol):
    def manifest(self, version: int, sha256: str | None) -> Manifest | None:
        """The version's checked manifest (None: not there)."""

    def read_full(self, step: Step, sinks: list[Sink]) -> None:
        """Read the step's whole files (full or adapter), checked, into `sinks`."""

    def delta_file(self, step: Step, scratch: Path) -> AbstractContextManager[Path]:
        """A file of the step's delta, checked chunk by chunk (a private copy under `scratch`,
        or the reader's own store's), for the time of the context."""


class StoreReader:
    """A weight store on this filesystem."""

    def __init__(self, store: WeightStore):
        self.store = store

    def manifest(self, version: int, sha256: str | None) -> Manifest | None:
        if not self.store.version_dir(version).is_dir():
            return None
        return self.store.manifest(version, sha256)

    def read_full(self, step: Step, sinks: list[Sink]) -> None:
        opened = self.store.open_version(step.version, step.manifest.digest, form=step.form)
        try:
            read_version(opened.manifest, opened.fds, sinks)
        finally:
            opened.close()

    @contextmanager
    def delta_file(self, step: Step, scratch: Path) -> Iterator[Path]:
        dest = Path(tempfile.mkdtemp(prefix=f"delta-v{step.version:08d}-", dir=scratch))
        try:
            self.read_full(step, [FileSink(dest)])  # the delta form: delta.bin alone
            yield dest / DELTA_FILE
        finally:
            shutil.rmtree(dest, ignore_errors=True)


def rebuild(
    reader: ChainReader,
    steps: list[Step],
    base: Path | None,
    scratch: Path,
    sinks: list[Sink],
) -> Path:
    """Run `steps` (module docstring); `base`: the full file the first step's delta applies to.
    Returns the directory (under `scratch`, the caller's to remove) holding the last version's
    full file."""
    out: Path | None = None
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        step_dir = Path(tempfile.mkdtemp(prefix=f"v{step.version:08d}-", dir=scratch))
        targets: list[Sink] = [FileSink(step_dir)] + (sinks if last else [])
        try:
            if step.form == "delta":
                if base is None:
                    raise CorruptWeights(f"weights v{step.version}: a delta with no base")
                _apply(reader, step, base, scratch, targets)
            else:
                reader.read_full(step, targets)
        except (CorruptWeights, OSError, ValueError) as e:
            shutil.rmtree(step_dir, ignore_errors=True)
            raise StepFailed(step, e) from e
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)  # an intermediate version's file
        out, base = step_dir, step_dir / MODEL_FILE
    assert out is not None, "an empty plan"
    return out


def _apply(reader: ChainReader, step: Step, base: Path, scratch: Path, sinks: list[Sink]) -> None:
    with reader.delta_file(step, scratch) as delta:
        with _open(delta) as delta_fd, _open(base) as base_fd:
            apply_delta(step.manifest, delta_fd, base_fd, sinks)


@contextmanager
def _open(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def rebuilt_tensors(
    store: WeightStore, version: int, expect_sha256: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of `version` on the host, verified, rebuilt from its anchor and deltas when
    it is stored as a delta (in a private directory of the store, removed after)."""
    reader = StoreReader(store)
    steps = plan(reader.manifest, version, expect_sha256, held=None)
    sink = TensorSink(host_tensors)
    with tempfile.TemporaryDirectory(prefix=".tmp-rebuild-", dir=store.root) as scratch:
        rebuild(reader, steps, None, Path(scratch), [sink])
    return sink.result()


def verified_tensors(
    store: WeightStore, version: int, expect_sha256: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a full version, read once from the store and verified, on the host: read
    whole (broker/weights/weight_stream.py `full_tensors`), or rebuilt from its anchor when it is
    stored as a delta."""
    kind = store.manifest(version, expect_sha256).kind
    if kind == "delta":
        return rebuilt_tensors(store, version, expect_sha256)
    if kind != "full":
        raise CorruptWeights(f"weights v{version}: an {kind} version")
    return full_tensors(store, version, expect_sha256)


__all__ = [
    "ChainReader",
    "Held",
    "StepFailed",
    "StoreReader",
    "rebuild",
    "rebuilt_tensors",
    "verified_tensors",
]
