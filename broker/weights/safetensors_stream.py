"""Writing a safetensors file and its digest in one pass over the bytes, and reading its header.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header (name -> dtype, shape, [begin, end) byte offsets into the data; `__metadata__`) padded
with spaces to a multiple of 8, then every tensor's raw little-endian bytes, back to back. The
library's `save_file` cannot hash what it writes: the weight store would have to read the whole
file again (or hold a second copy of it in memory with `save`), which is what this module avoids.
The file it writes loads with `safetensors.safe_open` / `load_file` like any other. Its digest is
the chunked sha256 of broker/weights/digest.py, hashed on several threads while the bytes are written.
`parse_header` reads the header back (a streamed reader, broker/weights/weight_stream.py, places each
tensor's bytes as they are verified) and checks that the tensors tile the data exactly.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rollflash.broker.weights.digest import CHUNK_BYTES, ChunkHasher, FileDigest

SLICE = 8 << 20  # bytes written per call

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
_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the format's own limit (safetensors refuses larger headers)
METADATA = {"format": "pt"}  # what save_pretrained writes, and the weight store too


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16", "F32", ...)."""
    return _DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors name."""
    return _FROM_NAME[name]


class BadHeader(ValueError):
    """A safetensors header that does not describe its file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file (not in the data section)
    end: int


def header_end(first8: bytes, file_size: int) -> int:
    """Where the data section starts (8 + the header's length), from the file's first 8 bytes."""
    (length,) = struct.unpack("<Q", first8[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise BadHeader(f"header of {length} bytes does not fit a file of {file_size}")
    return 8 + length


def parse_header(prefix: bytes, file_size: int) -> list[TensorEntry]:
    """The tensors of a safetensors file from its first `header_end` bytes, in file order. Their
    sizes must match dtype x shape and they must tile the data section with no gap or overlap."""
    end = header_end(prefix, file_size)
    try:
        entries = json.loads(prefix[8:end])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadHeader("unreadable header") from None
    if not isinstance(entries, dict):
        raise BadHeader("unreadable header")
    out = []
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _FROM_NAME[e["dtype"]], tuple(int(d) for d in e["shape"])
            begin, stop = (end + int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadHeader(f"tensor {name!r}: bad entry") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or stop - begin != numel * dtype.itemsize:
            raise BadHeader(f"tensor {name!r}: {stop - begin} bytes for {shape} {dtype}")
        out.append(TensorEntry(name, dtype, shape, begin, stop))
    out.sort(key=lambda t: (t.begin, t.end))
    at = end
    for t in out:
        if t.begin != at:
            raise BadHeader(f"tensor {t.name!r} starts at byte {t.begin}, expected {at}")
        at = t.end
    if at != file_size:
        raise BadHeader(f"the tensors end at byte {at}, the file at {file_size}")
    return out


def header_bytes(
    layout: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None
) -> bytes:
    """The header of a file holding `layout` (name, dtype name, shape, bytes), in that order,
    exactly as `write_safetensors` writes it (a reader rebuilds a file from a delta with it)."""
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, size in layout:
        entries[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    layout = [
        (name, _DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size())
        for name, t in tensors.items()
    ]
    return header_bytes(layout, metadata)


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: dict[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> FileDigest:
    """Write `tensors` (host tensors) to `path`, fsynced; returns its size and chunked digest.

    Each piece (the header, then every tensor's bytes as a view of its memory: no copy) goes to
    the hashing threads before it is written, so the chunks hash while the file is written; the
    last chunks hash while the file is fsynced."""
    ordered = {name: tensors[name].contiguous() for name in sorted(tensors)}
    hasher = ChunkHasher(chunk_bytes)
    try:
        with open(path, "wb") as f:
            for piece in _pieces(ordered, metadata):
                hasher.update(piece)
                for start in range(0, len(piece), SLICE):
                    f.write(piece[start : start + SLICE])
            f.flush()
            return _fsync_during(f.fileno(), hasher.result)
    except BaseException:
        hasher.close()
        raise


def _fsync_during(fd: int, work: Callable[[], FileDigest]) -> FileDigest:
    """`work()` (the last chunks' sha256) while another thread fsyncs `fd`: the disk's wait and
    the hashing overlap (both release the GIL); returns once both are done, raising the fsync's
    error first."""
    synced: list[BaseException | None] = []

    def fsync() -> None:
        try:
            os.fsync(fd)
            synced.append(None)
        except BaseException as e:  # handed to the caller below
            synced.append(e)

    thread = threading.Thread(target=fsync, name="fsync", daemon=True)
    thread.start()
    try:
        digest = work()
    finally:
        thread.join()
    if synced[0] is not None:
        raise synced[0]
    return digest


def _pieces(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> Iterator[memoryview]:
    """The header, then each tensor's bytes as a view of its memory (no copy)."""
    yield memoryview(_header(tensors, metadata))
    for t in tensors.values():
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().data
