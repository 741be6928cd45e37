"""Reading a weight version chunk by chunk, each chunk checked before anything uses its bytes.

A reader holds the version's manifest (broker/weights/manifest.py), already checked against the digest
the learner announced, so the manifest's sha256 of every chunk authenticates that chunk. Chunks
are read into a few reused buffers (one per core, at most `READERS`: all the extra memory a read
takes, whatever the version's size), each is hashed from its buffer and compared with the manifest, and
only then are the same bytes handed to the sinks:
- `TensorSink` places them into the tensors an engine allocated for the version (on its device),
  so the tensors an engine swaps in are exactly the bytes that were hashed;
- `FileSink` writes them into new private files (a generator's local store, or the copy an engine
  that only loads from a path reads): one read and one write.
A chunk that does not match, a file shorter than its manifest says, or a header that does not
describe its file is `CorruptWeights`, and nothing read so far is used. The chunks of a file are
read in order until every sink can take them in any order (a `TensorSink` needs the safetensors
header first), then several at a time: reads and sha256 release the GIL.

`read_version` reads files a store opened (broker/weights/weights.py `open_version`: no links, sizes
checked); broker/weights/weight_client.py feeds the same `ChunkCheck` from HTTP range requests.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from rollflash.broker.weights.digest import hash_threads
from rollflash.broker.weights.manifest import MODEL_FILE, CorruptWeights, FileSpec, Manifest
from rollflash.broker.weights.safetensors_stream import (
    BadHeader,
    TensorEntry,
    header_end,
    parse_header,
)

if TYPE_CHECKING:
    from rollflash.broker.weights.weights import WeightStore

READERS = 4  # at most this many chunks read and hashed at once (and no more than the cores)

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
Allocate = Callable[[Layout], dict[str, torch.Tensor]]


class Sink(Protocol):
    def open(self, spec: FileSpec) -> None:
        """Before the first chunk of a file."""

    def ready(self, name: str) -> bool:
        """Whether chunks of `name` may now arrive in any order."""

    def put(self, name: str, offset: int, data: memoryview) -> None:
        """Verified bytes of `name` at `offset` (called from several threads at once)."""

    def close(self) -> None:
        """After the last chunk, or after an error."""


def host_tensors(layout: Layout) -> dict[str, torch.Tensor]:
    """Empty host tensors for a version (`TensorSink`'s allocator when no engine is involved)."""
    return {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in layout}


class TensorSink:
    """Places the verified bytes of the safetensors file `name` into the tensors that
    `allocate(layout)` returns once the header is known (an engine checks the names and shapes
    against its model there, before any tensor data is read, and allocates on its device)."""

    def __init__(self, allocate: Allocate, name: str = MODEL_FILE):
        self.name, self._allocate = name, allocate
        self._size = 0
        self._prefix = bytearray()  # the header's bytes, gathered in order
        self._end: int | None = None  # where the data starts
        self._entries: list[TensorEntry] | None = None
        self._starts: list[int] = []
        self._flat: dict[str, torch.Tensor] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self._placed = 0
        self._lock = threading.Lock()

    def open(self, spec: FileSpec) -> None:
        if spec.name == self.name:
            self._size = spec.size

    def ready(self, name: str) -> bool:
        return name != self.name or self._entries is not None

    def put(self, name: str, offset: int, data: memoryview) -> None:
        if name != self.name:
            return
        if self._entries is None:  # in order from byte 0 until the header is parsed
            offset, data = self._take_header(offset, data)
        if len(data):
            self._place(offset, data)

    def _take_header(self, offset: int, data: memoryview) -> tuple[int, memoryview]:
        while self._entries is None:
            need = 8 if self._end is None else self._end
            take = min(len(data), need - len(self._prefix))
            self._prefix += data[:take]
            data, offset = data[take:], offset + take
            if len(self._prefix) < need:
                break
            try:
                if self._end is None:
                    self._end = header_end(bytes(self._prefix), self._size)
                else:
                    self._start_tensors(parse_header(bytes(self._prefix), self._size))
            except BadHeader as e:
                raise CorruptWeights(f"{self.name}: {e}; refusing to load") from None
        return offset, data

    def _start_tensors(self, entries: list[TensorEntry]) -> None:
        self.tensors = self._allocate([(t.name, t.shape, t.dtype) for t in entries])
        self._flat = {t.name: self.tensors[t.name].view(-1).view(torch.uint8) for t in entries}
        self._starts = [t.begin for t in entries]
        self._entries = entries

    def _place(self, offset: int, data: memoryview) -> None:
        assert self._entries is not None
        end = offset + len(data)
        src = torch.frombuffer(data, dtype=torch.uint8)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self._entries) and self._entries[i].begin < end:
            t = self._entries[i]
            a, b = max(t.begin, offset), min(t.end, end)
            if b > a:
                self._flat[t.name][a - t.begin : b - t.begin].copy_(src[a - offset : b - offset])
            i += 1
        with self._lock:
            self._placed += len(data)

    def result(self) -> dict[str, torch.Tensor]:
        """The tensors, once every byte of the data section has been placed."""
        if self._end is None or self._entries is None or self._placed != self._size - self._end:
            raise CorruptWeights(f"{self.name}: incomplete; refusing to load")
        return self.tensors

    def close(self) -> None:
        pass


class FileSink:
    """Writes the verified bytes into new files of `directory` (a directory the caller owns),
    each created here at its full size, mode 0600, never through a link or over a file."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.fds: dict[str, int] = {}

    def open(self, spec: FileSpec) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.directory / spec.name, flags, 0o600)
        self.fds[spec.name] = fd
        os.ftruncate(fd, spec.size)

    def ready(self, name: str) -> bool:
        return True

    def put(self, name: str, offset: int, data: memoryview) -> None:
        fd = self.fds[name]
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class ChunkCheck:
    """Checks each chunk against the manifest, then hands it to the sinks; `on_chunk(name,
    index)` hears of every chunk that passed (a relay serves it from then on). `files`: the
    files read (a form of the version, `Manifest.form_files`), all of them by default."""

    def __init__(
        self,
        manifest: Manifest,
        sinks: list[Sink],
        on_chunk: Callable[[str, int], None] | None = None,
        files: tuple[str, ...] | None = None,
    ):
        self.manifest, self.sinks, self.on_chunk = manifest, sinks, on_chunk
        self.files = tuple(manifest.files) if files is None else files
        for spec in (manifest.files[n] for n in self.files):
            for sink in sinks:
                sink.open(spec)

    def ready(self, name: str) -> bool:
        return all(sink.ready(name) for sink in self.sinks)

    def accept(self, name: str, index: int, data: memoryview) -> None:
        spec = self.manifest.files[name]
        start, end = spec.span(index)
        v = self.manifest.version
        if len(data) != end - start:
            raise CorruptWeights(
                f"weights v{v}: {name} holds {start + len(data)} bytes where its manifest says "
                f"{spec.size} (truncated); refusing to load"
            )
        if hashlib.sha256(data).hexdigest() != spec.chunks[index]:
            raise CorruptWeights(
                f"weights v{v}: sha256 mismatch in {name}, chunk {index} (bytes {start}-{end}); "
                "refusing to load"
            )
        for sink in self.sinks:
            sink.put(name, start, data)
        if self.on_chunk is not None:
            self.on_chunk(name, index)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class ChunkBuffers:
    """`count` reusable buffers of `size` bytes: taken while a chunk is read and checked."""

    def __init__(self, size: int, count: int):
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(memoryview(bytearray(size)))

    @contextmanager
    def take(self) -> Iterator[memoryview]:
        buf = self._free.get()
        try:
            yield buf
        finally:
            self._free.put(buf)


def chunk_order(manifest: Manifest, files: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """Every chunk of `files` (all the manifest's by default), in file order."""
    names = manifest.files if files is None else files
    return [(n, i) for n in names for i in range(len(manifest.files[n].chunks))]


def read_version(
    manifest: Manifest,
    fds: dict[str, int],
    sinks: list[Sink],
    readers: int | None = None,
) -> None:
    """Read every chunk of the open files `fds` (all of the manifest's files, or those of one
    form) once, check it, and hand it to `sinks`, with `readers` threads (None: as many as the
    cores, at most READERS)."""
    readers = readers or min(READERS, hash_threads())
    files = tuple(fds)
    specs = [manifest.files[n] for n in files]
    largest = max((min(f.chunk_bytes, f.size) for f in specs), default=0)
    buffers = ChunkBuffers(max(1, largest), readers)
    check = ChunkCheck(manifest, sinks, files=files)

    def one(name: str, index: int) -> None:
        start, end = manifest.files[name].span(index)
        with buffers.take() as buf:
            got = _read_at(fds[name], buf[: end - start], start)
            check.accept(name, index, buf[:got])

    try:
        run_in_order(check, chunk_order(manifest, files), one, readers)
    finally:
        check.close()


def run_in_order(
    check: ChunkCheck,
    chunks: list[tuple[str, int]],
    one: Callable[[str, int], None],
    workers: int,
) -> None:
    """`one(name, index)` for every chunk: in order while the sinks need it, then on `workers`
    threads; the first error stops the rest and is raised."""
    with ThreadPoolExecutor(workers, "verify") as pool:
        i = 0
        while i < len(chunks) and not check.ready(chunks[i][0]):
            one(*chunks[i])
            i += 1
        futures = [pool.submit(one, *c) for c in chunks[i:]]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        for f in done:
            f.result()


def _read_at(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; returns the bytes read (fewer at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def full_tensors(
    store: WeightStore, version: int, expect_sha256: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a version stored whole, read once from the store and verified, on the
    host (any version: broker/weights/weight_chain.py `verified_tensors`)."""
    opened = store.open_version(version, expect_sha256, form="full")
    try:
        sink = TensorSink(host_tensors)
        read_version(opened.manifest, opened.fds, [sink])
        return sink.result()
    finally:
        opened.close()


def copy_verified(
    store: WeightStore, version: int, dest: Path, expect_sha256: str | None = None
) -> Manifest:
    """Write the verified files of `version` (a full one's model file, an adapter's two files)
    into the new directory `dest` (mode 0700, in a directory the caller owns): what is loaded
    from there is what was hashed."""
    kind = store.manifest(version, expect_sha256).kind
    if kind == "delta":
        raise CorruptWeights(f"weights v{version} is stored as a delta: read it with a plan")
    opened = store.open_version(version, expect_sha256, form=kind)
    try:
        dest.mkdir(mode=0o700)
        read_version(opened.manifest, opened.fds, [FileSink(dest)])
        return opened.manifest
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        opened.close()
