"""A weight version's manifest: what a reader checks before it trusts a single byte of a version.

`manifest.json` (written last into a version directory, broker/weights.py) names the version, its
step and kind, and per file its size and chunked digest (broker/digest.py): the sha256 of every
`chunk_bytes` chunk (`chunk_sha256`) and the file's `digest` over that listing. A version's own
digest (`version_digest`) is what the learner announces in the `weights` hash: a full version's
model file digest or, for an adapter, the sha256 of its listing `"{digest}  {name}\\n"` per file
in name order, so the adapter's config is covered too.

`parse_manifest` accepts a manifest only when it describes the version asked for, every chunk
listing fits its file's size and hashes to the file's digest, and the version's digest is the
announced one: from then on each chunk's sha256 authenticates that chunk's bytes, wherever they
come from (the shared store, the learner over HTTP, or another generator relaying them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from rollflash.broker.digest import tree_digest
from rollflash.errors import RollflashError

MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
KIND_FILES = {"full": (MODEL_FILE,), "adapter": (ADAPTER_FILE, ADAPTER_CONFIG)}
TENSOR_FILES = {"full": MODEL_FILE, "adapter": ADAPTER_FILE}
MAX_MANIFEST_BYTES = 64 << 20  # ~1.3M chunks: a manifest of a 40 TB version


class CorruptWeights(RollflashError, RuntimeError):
    """A version whose files do not match its manifest (or that has no manifest)."""


def version_digest(kind: str, file_digests: dict[str, str]) -> str:
    """The digest announced for a version: a full version's model file digest, or the sha256 of
    an adapter's listing (`sha256sum` format, files in name order)."""
    if kind == "full":
        return file_digests[MODEL_FILE]
    listing = "".join(f"{file_digests[n]}  {n}\n" for n in sorted(file_digests))
    return hashlib.sha256(listing.encode()).hexdigest()


@dataclass(frozen=True)
class FileSpec:
    """One file of a version as its manifest describes it."""

    name: str
    size: int
    chunk_bytes: int
    chunks: tuple[str, ...]  # each chunk's sha256 (hex), in file order
    digest: str

    def span(self, index: int) -> tuple[int, int]:
        """The byte range [start, end) of chunk `index`."""
        start = index * self.chunk_bytes
        return start, min(self.size, start + self.chunk_bytes)


@dataclass(frozen=True)
class Manifest:
    version: int
    step: int
    kind: str  # "full" or "adapter"
    files: dict[str, FileSpec]
    raw: bytes  # the manifest's bytes as read: a relay passes on exactly these

    @property
    def digest(self) -> str:
        return version_digest(self.kind, {n: f.digest for n, f in self.files.items()})

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


def parse_manifest(raw: bytes, version: int, expect_sha256: str | None = None) -> Manifest:
    """The manifest in `raw` if it describes `version` consistently (and, with `expect_sha256`,
    is the one announced), else CorruptWeights naming what is wrong."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptWeights(f"weights v{version}: manifest of {len(raw)} bytes, too large")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CorruptWeights(f"weights v{version}: unreadable manifest") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    entries = data.get("files") if isinstance(data, dict) else None
    if (
        data.get("version") != version
        or kind not in KIND_FILES
        or not isinstance(entries, dict)
        or type(data.get("step")) is not int
    ):
        raise CorruptWeights(f"weights v{version}: manifest does not describe this version")
    files = {name: _file_spec(version, name, entries.get(name)) for name in KIND_FILES[kind]}
    manifest = Manifest(version, data["step"], kind, files, raw)
    if expect_sha256 is not None and manifest.digest != expect_sha256:
        raise CorruptWeights(
            f"weights v{version}: sha256 mismatch: the manifest is not the announced version's; "
            "refusing to load"
        )
    return manifest


def _file_spec(version: int, name: str, entry: Any) -> FileSpec:
    """A file's entry, checked: the chunk listing fits the size before anything is hashed, so a
    manifest cannot make a reader hash in tiny pieces, and it hashes to the file's digest."""
    if not isinstance(entry, dict):
        raise CorruptWeights(f"weights v{version}: the manifest lists no {name}")
    size, chunk_bytes, chunks = (
        entry.get("size"),
        entry.get("chunk_bytes"),
        entry.get("chunk_sha256"),
    )
    if (
        type(size) is not int
        or size < 0
        or type(chunk_bytes) is not int
        or chunk_bytes <= 0
        or not isinstance(chunks, list)
        or len(chunks) != -(-size // chunk_bytes)
        or not all(isinstance(c, str) and len(c) == 64 for c in chunks)
        or entry.get("digest") != tree_digest(chunk_bytes, size, chunks)
    ):
        raise CorruptWeights(
            f"weights v{version}: sha256 mismatch: the manifest's chunk listing of {name} "
            "does not fit its size and digest; refusing to load"
        )
    return FileSpec(name, size, chunk_bytes, tuple(chunks), entry["digest"])
