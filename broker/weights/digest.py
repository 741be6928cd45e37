"""The digest of a weight file: sha256 over fixed-size chunks, hashed on several cores.

One sha256 stream runs on one core at well under the speed of writing the bytes (about 0.8 GB/s
here, with the SHA extensions), so a file's digest is a two-level sha256 tree instead: the file is
cut into chunks of `chunk_bytes` (the last one shorter), each chunk's sha256 is computed in a
worker thread (hashlib releases the GIL on large buffers, so the chunks hash in parallel, and in
parallel with the writing), and the file's digest is the sha256 of its listing

    "sha256-chunks {chunk_bytes} {size}\\n" + "{chunk sha256 hex}\\n" for every chunk, in order

so it binds the size, the chunking and every chunk's bytes; finding two files with one digest
means finding a sha256 collision. To check it by hand: `split -b {chunk_bytes} -d FILE c.` and
`sha256sum c.*` give the chunk digests the manifest lists.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

CHUNK_BYTES = 32 << 20  # ~30 chunks per GB: enough for the cores to share, a short manifest
MAX_THREADS = 8


def hash_threads() -> int:
    """Threads hashing chunks: the cores this process may use, at most MAX_THREADS."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cores))


def _sha256_of(pieces: list[memoryview]) -> str:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def tree_digest(chunk_bytes: int, size: int, chunks: list[str]) -> str:
    """The file's digest from its chunks' sha256 (the listing in the module docstring)."""
    listing = f"sha256-chunks {chunk_bytes} {size}\n" + "".join(f"{c}\n" for c in chunks)
    return hashlib.sha256(listing.encode()).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    size: int
    chunk_bytes: int
    chunks: list[str] = field(default_factory=list)  # each chunk's sha256, in file order

    @property
    def digest(self) -> str:
        return tree_digest(self.chunk_bytes, self.size, self.chunks)

    def manifest_entry(self) -> dict[str, Any]:
        """What the manifest records for the file (weights.py reads it back)."""
        return {
            "size": self.size,
            "digest": self.digest,
            "chunk_bytes": self.chunk_bytes,
            "chunk_sha256": list(self.chunks),
        }


class ChunkHasher:
    """Hashes a byte stream handed over piece by piece: each full chunk goes to a thread pool as
    soon as more bytes follow it, so hashing overlaps with whatever the caller does next (writing
    the pieces). The pieces are referenced, not copied: they must stay unchanged until `result()`.
    A stream of one chunk (a small model's weights) is hashed in the calling thread at `result()`:
    a pool would only add the cost of starting a thread."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, threads: int | None = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first full chunk
        self._done: list[Future[str]] = []
        self._current: list[memoryview] = []
        self._filled = 0
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            if self._filled == self.chunk_bytes:  # a full chunk, and more follows: hash it
                self._submit()
            take = min(len(view), self.chunk_bytes - self._filled)
            self._current.append(view[:take])
            self._filled += take
            view = view[take:]

    def _submit(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads or hash_threads(), "sha256")
        self._done.append(self._pool.submit(_sha256_of, self._current))
        self._current, self._filled = [], 0

    def result(self) -> FileDigest:
        """Wait for every chunk's sha256; the hasher cannot be used afterwards."""
        try:
            if self._filled and self._pool is None:  # the whole stream is one chunk
                return FileDigest(self.size, self.chunk_bytes, [_sha256_of(self._current)])
            if self._filled:
                self._submit()
            return FileDigest(self.size, self.chunk_bytes, [f.result() for f in self._done])
        finally:
            self.close()

    def close(self) -> None:
        """Stop hashing (what is queued is dropped): after an error, or once `result` is in."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def file_digest(data: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> FileDigest:
    """The chunked digest of bytes held in memory, hashed on several cores."""
    hasher = ChunkHasher(chunk_bytes)
    hasher.update(data)
    return hasher.result()
