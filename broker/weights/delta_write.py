"""Writing weight versions as deltas against the version before (`weights.anchor_every` > 1).

`VersionChain` lives where versions are published (the learner's publishing process, or the step
with `trainer.background_publish: false`) and keeps the bytes of the last version it published in
a private file beside the store, `{run_dir}/publishing/state.bin`, memory-mapped (page cache, not
the process's own memory; removed when the process closes, and by the next one if it died). Each
new version is compared with it tensor by tensor, in the full file's order (by name): a tensor's
changed elements are encoded (broker/weights/delta.py) and appended to `delta.bin`, the
sha256 of its new bytes is taken for the manifest, and its new bytes replace the old ones in the
state file. So the work holds one tensor's comparison at a time (in slices), whatever the model's
size, and the learner's step is not involved.

What a version is (`write`):
- `delta`: its changes against the version before, when that is the version this chain published
  last (with the same tensors), and the delta is smaller than the full file;
- `full` with a delta too (an anchor), every `anchor_every` versions: a generator that holds the
  version before fetches the delta, one that joins late starts from the full file;
- `full` alone: the first version this process publishes (after a start or a resume: it holds no
  earlier bytes), after a failed publish, when the tensors' names, shapes or dtypes changed, or
  when the delta would not be smaller than the full file.
A failed write leaves the chain empty, so the next version is a full one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollflash.broker.weights.delta import Change, as_bits, encode_change
from rollflash.broker.weights.digest import ChunkHasher, hash_threads
from rollflash.broker.weights.manifest import DELTA_FILE, MODEL_FILE
from rollflash.broker.weights.manifest_delta import ITEMSIZE, ChangeSpec, TensorSpec, delta_section
from rollflash.broker.weights.safetensors_stream import METADATA, dtype_name, write_safetensors

ALIGN = 64
Layout = list[tuple[str, str, tuple[int, ...]]]  # name, dtype name, shape


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a uint8 array (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def _sha256(data: np.ndarray) -> str:
    return hashlib.sha256(data.data).hexdigest()


class _DeltaFile:
    """`delta.bin`, written change by change while its chunks are hashed; abandoned once it
    reaches `budget` bytes (the full file's size: a delta must be smaller)."""

    def __init__(self, path: Path, budget: int):
        self.path, self.budget = path, budget
        self._f: Any = open(path, "wb")
        self._hasher = ChunkHasher()
        self.size = 0

    def add(self, change: Change) -> ChangeSpec | None:
        """Append `change`; None (and the file is gone) once the delta is not smaller."""
        if self.size + change.nbytes >= self.budget:
            self.abandon()
            return None
        spec = ChangeSpec(
            change.encoding,
            change.count,
            self.size,
            change.positions.nbytes,
            change.values.nbytes,
        )
        for part in (change.positions, change.values):
            view = np.ascontiguousarray(part).view(np.uint8).data
            self._hasher.update(view)
            self._f.write(view)
        self.size += change.nbytes
        return spec

    def abandon(self) -> None:
        self._hasher.close()
        self._f.close()
        self.path.unlink(missing_ok=True)

    def finish(self) -> dict[str, Any]:
        """Fsync the file; returns its manifest entry."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._hasher.result().manifest_entry()


class VersionChain:
    """The publisher's memory of the last version it published (module docstring)."""

    def __init__(self, directory: Path, anchor_every: int):
        self.dir = Path(directory)
        shutil.rmtree(self.dir, ignore_errors=True)  # an earlier process's: never trusted
        self.dir.mkdir(mode=0o700, parents=True)
        self.anchor_every = anchor_every
        self.version: int | None = None  # the version the state file holds (None: nothing)
        self.digest = ""
        self._layout: Layout = []
        self._offsets: dict[str, int] = {}
        self._state: np.memmap | None = None
        self.last_changed = 0  # elements the last delta changed (benchmarks, logs)

    def write(
        self, tmp: Path, tensors: dict[str, torch.Tensor], version: int
    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """Write version `version` of `tensors` (host tensors) into the directory `tmp`; returns
        its kind, its files' manifest entries and the manifest's delta section (or nothing).
        The chain holds nothing until `published` says the version is in place."""
        names = sorted(tensors)
        layout = [(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names]
        previous = self.version == version - 1 and layout == self._layout
        base_digest, self.version = self.digest, None
        if not previous:
            self._reset(layout)
        data_size = sum(int(t.numel()) * t.element_size() for t in tensors.values())
        delta = _DeltaFile(tmp / DELTA_FILE, budget=data_size) if previous else None
        specs, delta = self._update(tensors, layout, delta)
        files: dict[str, dict[str, Any]] = {}
        if delta is not None:
            files[DELTA_FILE] = delta.finish()
        if delta is None or version % self.anchor_every == 0:
            ordered = {n: tensors[n] for n in names}
            written = write_safetensors(ordered, tmp / MODEL_FILE, METADATA)
            files[MODEL_FILE] = written.manifest_entry()
        if delta is None:
            return "full", files, {}
        section = delta_section(version - 1, base_digest, METADATA, specs)
        return ("full" if MODEL_FILE in files else "delta"), files, {"delta": section}

    def _update(
        self, tensors: dict[str, torch.Tensor], layout: Layout, delta: _DeltaFile | None
    ) -> tuple[list[TensorSpec], _DeltaFile | None]:
        """Compare each tensor with the state file and encode its change into `delta` (None
        once abandoned), take its sha256 (with a delta), and put its bytes in the state file."""
        pending: list[tuple[str, str, tuple[int, ...], ChangeSpec | None, Future[str]]] = []
        self.last_changed = 0
        with ThreadPoolExecutor(hash_threads(), "sha256") as pool:
            for name, dtype, shape in layout:
                new = _bytes(tensors[name])
                old = self._view(name, new.nbytes)
                if delta is not None:
                    item = ITEMSIZE[dtype]
                    encoded = encode_change(as_bits(old, item), as_bits(new, item))
                    change = delta.add(encoded) if encoded is not None else None
                    if encoded is not None:
                        self.last_changed += encoded.count
                        delta = delta if change is not None else None  # None: not smaller
                    pending.append((name, dtype, shape, change, pool.submit(_sha256, new)))
                old[:] = new
        specs = [TensorSpec(n, d, s, f.result(), c) for n, d, s, c, f in pending]
        return specs, delta

    def close(self) -> None:
        self._state, self.version = None, None
        shutil.rmtree(self.dir, ignore_errors=True)

    def published(self, version: int, digest: str) -> None:
        """`version` (announced as `digest`) is in place: the next version may be a delta."""
        self.version, self.digest = version, digest

    def _reset(self, layout: Layout) -> None:
        self._state = None
        self._layout, self._offsets, at = layout, {}, 0
        for name, dtype, shape in layout:
            self._offsets[name] = at
            at += -(-int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype] // ALIGN) * ALIGN
        path = self.dir / "state.bin"
        path.unlink(missing_ok=True)
        self._state = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(at, 1),))

    def _view(self, name: str, nbytes: int) -> np.ndarray:
        assert self._state is not None
        at = self._offsets[name]
        return self._state[at : at + nbytes]
