"""Applying a verified delta to the full file of its base version: the full file of the new one.

A generator that holds version v-1 (a verified copy of its full file, generators/held.py) and has
fetched v's delta file, checked chunk by chunk against v's manifest (broker/weights/weight_stream.py),
rebuilds v's full file tensor by tensor, in the file's order: the header from the manifest's
tensor table (the bytes `write_safetensors` writes for those tensors, so the file is byte for byte
the one a full version would have), then each tensor's bytes read from the base in slices of
`SLICE` bytes, its changed elements written in (broker/weights/delta.py), and the result hashed. A tensor
whose sha256 differs from the manifest's (a base that is not v-1, a delta that does not apply)
is `CorruptWeights`. The bytes go to the same sinks a full read feeds (`TensorSink`: tensors the
engine allocated for the version; `FileSink`: a new private file) as they are rebuilt; those are
used only once every tensor has matched, and discarded otherwise, so what is loaded is exactly
what was checked. Tensors are rebuilt on a few threads (hashing and copying release the GIL),
each with one slice buffer: memory stays a few slices and the positions of one tensor.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rollflash.broker.weights.delta import BadDelta, as_bits, decode_positions
from rollflash.broker.weights.digest import CHUNK_BYTES, hash_threads
from rollflash.broker.weights.manifest import MODEL_FILE, CorruptWeights, FileSpec, Manifest
from rollflash.broker.weights.manifest_delta import ITEMSIZE, DeltaSpec, TensorSpec
from rollflash.broker.weights.safetensors_stream import header_bytes
from rollflash.broker.weights.weight_stream import READERS, Sink

SLICE = 32 << 20  # bytes of a tensor rebuilt at a time


def full_header(delta: DeltaSpec) -> bytes:
    """The header of the full file of the version `delta` describes."""
    layout = [(t.name, t.dtype, t.shape, t.nbytes) for t in delta.tensors]
    return header_bytes(layout, delta.metadata)


def full_file(delta: DeltaSpec) -> FileSpec:
    """The full file a delta rebuilds, as the sinks see it (its name and size)."""
    size = len(full_header(delta)) + sum(t.nbytes for t in delta.tensors)
    return FileSpec(MODEL_FILE, size, CHUNK_BYTES, (), "")


def _read_exact(fd: int, size: int, offset: int, what: str) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CorruptWeights(f"{what} ends before byte {offset + size}")
        got += n
    return buf


def apply_delta(
    manifest: Manifest, delta_fd: int, base_fd: int, sinks: list[Sink], readers: int | None = None
) -> None:
    """Rebuild `manifest`'s version into `sinks` from the verified delta file `delta_fd` and the
    base's full file `base_fd` (module docstring)."""
    delta, v = manifest.delta, manifest.version
    if delta is None:
        raise CorruptWeights(f"weights v{v}: no delta to apply")
    header = full_header(delta)
    if bytes(_read_exact(base_fd, len(header), 0, f"the base of v{v}")) != header:
        raise CorruptWeights(
            f"weights v{v}: the held v{delta.base} does not have this version's tensors "
            "(names, dtypes, shapes); refusing to apply its delta"
        )
    spec = full_file(delta)
    for sink in sinks:
        sink.open(spec)
    try:
        for sink in sinks:
            sink.put(MODEL_FILE, 0, memoryview(header))
        begins, at = [], len(header)
        for t in delta.tensors:
            begins.append(at)
            at += t.nbytes
        workers = readers or min(READERS, hash_threads())
        with ThreadPoolExecutor(workers, "apply") as pool:
            jobs = [
                pool.submit(_rebuild, v, t, begin, delta_fd, base_fd, sinks)
                for t, begin in zip(delta.tensors, begins)
            ]
            for job in jobs:
                job.result()
    finally:
        for sink in sinks:
            sink.close()


def _rebuild(
    version: int, t: TensorSpec, begin: int, delta_fd: int, base_fd: int, sinks: list[Sink]
) -> None:
    """One tensor: base bytes, its change written in, hashed, handed to the sinks."""
    item = ITEMSIZE[t.dtype]
    positions = values = None
    if t.change is not None:
        c = t.change
        data = np.frombuffer(_read_exact(delta_fd, c.positions, c.offset, "the delta"), np.uint8)
        try:
            positions = decode_positions(c.encoding, data, c.count, t.numel)
        except BadDelta as e:
            raise CorruptWeights(f"weights v{version}: {t.name}: {e}; refusing to apply") from None
        raw = _read_exact(delta_fd, c.values, c.offset + c.positions, "the delta")
        values = as_bits(raw, item)
    digest = hashlib.sha256()
    step = max(item, SLICE - SLICE % item)
    for start in range(0, t.nbytes, step):
        buf = _read_exact(base_fd, min(step, t.nbytes - start), begin + start, "the base")
        if positions is not None and values is not None:
            a, b = start // item, (start + len(buf)) // item
            lo, hi = np.searchsorted(positions, [a, b])
            as_bits(buf, item)[positions[lo:hi] - a] = values[lo:hi]
        digest.update(buf)
        for sink in sinks:
            sink.put(MODEL_FILE, begin + start, memoryview(buf))
    if digest.hexdigest() != t.sha256:
        raise CorruptWeights(
            f"weights v{version}: sha256 mismatch in {t.name} after applying the delta to "
            f"v{version - 1}; refusing to load"
        )
