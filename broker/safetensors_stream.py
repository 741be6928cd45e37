"""Writing a safetensors file and its sha256 in one pass over the bytes.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header (name -> dtype, shape, [begin, end) byte offsets into the data; `__metadata__`) padded
with spaces to a multiple of 8, then every tensor's raw little-endian bytes, back to back. The
library's `save_file` cannot hash what it writes: the weight store would have to read the whole
file again (or hold a second copy of it in memory with `save`), which is what this module avoids.
The file it writes loads with `safetensors.safe_open` / `load_file` like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SLICE = 8 << 20  # bytes written (and hashed) per call

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write `tensors` (host tensors) to `path`, fsynced; returns (size in bytes, sha256 hex).

    The bytes go out in slices of SLICE bytes; a second thread hashes each slice while the next
    one is written (hashlib releases the GIL on large buffers), in order."""
    digest = hashlib.sha256()
    ordered = {name: tensors[name].contiguous() for name in sorted(tensors)}
    size = 0
    with open(path, "wb") as f, ThreadPoolExecutor(1, "sha256") as hasher:
        hashed = []
        for chunk in _chunks(ordered, metadata):
            for start in range(0, len(chunk), SLICE):
                piece = chunk[start : start + SLICE]
                hashed.append(hasher.submit(digest.update, piece))
                f.write(piece)
                size += len(piece)
                hashed = [h for h in hashed if not h.done()]
        for h in hashed:
            h.result()
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _chunks(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> Iterator[bytes | memoryview]:
    """The header, then each tensor's bytes as a view of its memory (no copy)."""
    yield _header(tensors, metadata)
    for t in tensors.values():
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().data
