"""A weight version's manifest: what a reader checks before it trusts a single byte of a version.

`manifest.json` (written last into a version directory, broker/weights/weights.py) names the version, its
step and kind, and per file its size and chunked digest (broker/weights/digest.py): the sha256 of every
`chunk_bytes` chunk (`chunk_sha256`) and the file's `digest` over that listing. Kinds: `full`
(`model.safetensors`), `adapter` (a PEFT adapter's two files) and `delta` (`delta.bin`, the
changes against the version before it, broker/weights/delta.py). A version with a delta (kind `delta`, or
a `full` anchor that also carries one) has a `delta` section (`DeltaSpec`): its base version and
the base's digest, the safetensors metadata of the full file, and per tensor, in the full file's
order, its dtype, shape, the sha256 of its bytes *after* applying, and where its change lies in
`delta.bin` (none: unchanged). A reader checks the result of applying, not only the transfer.

A version's own digest (`version_digest`) is what the learner announces in the `weights` hash: a
full version's model file digest; for an adapter, the sha256 of its listing
`"{digest}  {name}\\n"` per file in name order, so the adapter's config is covered too; for a
version with a delta, the sha256 of the manifest's bytes, which cover every field a reader uses.
Through `base_sha256` the newest version's manifest authenticates the one before it, and so on
down a chain of deltas: a reader that trusts only the announced digest can check every version it
reads on its way.

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

from rollflash.broker.weights.digest import tree_digest
from rollflash.broker.weights.manifest_delta import DeltaSpec, parse_delta
from rollflash.errors import RollflashError

MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DELTA_FILE = "delta.bin"
KIND_FILES = {
    "full": (MODEL_FILE,),
    "adapter": (ADAPTER_FILE, ADAPTER_CONFIG),
    "delta": (DELTA_FILE,),
}
TENSOR_FILES = {"full": MODEL_FILE, "adapter": ADAPTER_FILE}
MAX_MANIFEST_BYTES = 64 << 20  # ~1.3M chunks: a manifest of a 40 TB version
FORMS = ("full", "delta", "adapter")  # how a version can be read: the files of each


class CorruptWeights(RollflashError, RuntimeError):
    """A version whose files do not match its manifest (or that has no manifest)."""


def version_digest(kind: str, file_digests: dict[str, str], raw: bytes | None = None) -> str:
    """The digest announced for a version: a full version's model file digest, the sha256 of an
    adapter's listing (`sha256sum` format, files in name order), or with a delta (`raw`, the
    manifest's bytes) the sha256 of the manifest."""
    if raw is not None:
        return hashlib.sha256(raw).hexdigest()
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
    kind: str  # "full", "adapter" or "delta"
    files: dict[str, FileSpec]
    raw: bytes  # the manifest's bytes as read: a relay passes on exactly these
    delta: DeltaSpec | None = None  # with a delta against the version before

    @property
    def digest(self) -> str:
        raw = self.raw if self.delta is not None else None
        return version_digest(self.kind, {n: f.digest for n, f in self.files.items()}, raw)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def forms(self) -> tuple[str, ...]:
        """How this version can be read: `full` (or `adapter`) whole, and/or as a `delta`."""
        whole = () if self.kind == "delta" else (self.kind,)
        return whole + (("delta",) if self.delta is not None else ())

    def form_files(self, form: str) -> tuple[str, ...]:
        """The files a reader of `form` reads."""
        if form not in self.forms:
            raise CorruptWeights(f"weights v{self.version}: no {form} form in its manifest")
        return (DELTA_FILE,) if form == "delta" else KIND_FILES[self.kind]

    def form_size(self, form: str) -> int:
        """The bytes a reader of `form` fetches."""
        return sum(self.files[n].size for n in self.form_files(form))


def parse_manifest(raw: bytes, version: int, expect_sha256: str | None = None) -> Manifest:
    """The manifest in `raw` if it describes `version` consistently (and, with `expect_sha256`,
    is the one announced), else CorruptWeights naming what is wrong."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptWeights(f"weights v{version}: manifest of {len(raw)} bytes, too large")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CorruptWeights(f"weights v{version}: unreadable manifest") from None
    if not isinstance(data, dict):
        raise CorruptWeights(f"weights v{version}: manifest does not describe this version")
    kind, entries = data.get("kind"), data.get("files")
    if (
        data.get("version") != version
        or kind not in KIND_FILES
        or not isinstance(entries, dict)
        or type(data.get("step")) is not int
    ):
        raise CorruptWeights(f"weights v{version}: manifest does not describe this version")
    names = KIND_FILES[kind] + ((DELTA_FILE,) if kind == "full" and DELTA_FILE in entries else ())
    files = {name: _file_spec(version, name, entries.get(name)) for name in names}
    delta = None
    if DELTA_FILE in files:
        try:
            delta = parse_delta(version, data.get("delta"), files[DELTA_FILE].size)
        except ValueError as e:
            raise CorruptWeights(f"weights v{version}: manifest: {e}; refusing to load") from None
    elif "delta" in data:
        raise CorruptWeights(f"weights v{version}: a delta section without {DELTA_FILE}")
    manifest = Manifest(version, data["step"], kind, files, raw, delta)
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
