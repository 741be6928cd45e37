"""The versioned weight store on a shared filesystem.

Layout: `{run_dir}/weights/v{version:08d}/` holds `manifest.json` (version, step, kind, files with
sizes and digests) and the files of its kind: `full` = `model.safetensors` (every weight),
`adapter` = `adapter_model.safetensors` + `adapter_config.json` (a standard PEFT LoRA adapter for
the base at `model.path`, `learner/lora.py`). `{run_dir}/weights/LATEST` names the newest version.

A file's digest is the chunked sha256 of broker/digest.py (the manifest lists each chunk's sha256
under `chunk_sha256`, the chunk size and the `digest`); manifests written before it give a
whole-file `sha256` instead, and are still read. A version's digest (`VersionInfo.sha256`,
announced as `sha256` in the `weights` hash) is its model file's digest for a full version and,
for an adapter, the sha256 of its listing `"{digest}  {name}\n"` per file in name order, so the
adapter's config is covered too.

Invariants a reader can rely on:
- A version directory appears by one atomic rename of a fully written and fsynced temp directory,
  and its manifest is the last file written inside it: a reader never sees a half-written version.
- `verified_files(v)` reads each file of the version once and checks the size and digest of those
  bytes against the manifest (and the digest against the announced one), so a truncated,
  bit-flipped or swapped file is refused with `CorruptWeights`; a generator loads a private copy
  of exactly those bytes (`verified_copy_dir`), so a file changed in the store after the check is
  never loaded. Symbolic links (a version directory, its manifest or one of its files) and
  anything outside the store are refused, never followed. Adapter versions follow the same rules
  and the same retention as full ones.
- Retention deletes old versions but never one that a caller says is still in use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollflash.broker.digest import file_digest, tree_digest
from rollflash.broker.safetensors_stream import write_safetensors

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
KIND_FILES = {"full": (MODEL_FILE,), "adapter": (ADAPTER_FILE, ADAPTER_CONFIG)}


class CorruptWeights(RuntimeError):
    """A version whose files do not match its manifest (or that has no manifest)."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    path: str  # the version directory
    sha256: str  # the version's digest: model.safetensors' digest, or an adapter's listing's
    step: int
    kind: str = "full"  # or "adapter"


def version_digest(kind: str, file_digests: dict[str, str]) -> str:
    """The digest announced for a version: a full version's model file digest, or the sha256 of
    an adapter's listing (`sha256sum` format, files in name order)."""
    if kind == "full":
        return file_digests[MODEL_FILE]
    listing = "".join(f"{file_digests[n]}  {n}\n" for n in sorted(file_digests))
    return hashlib.sha256(listing.encode()).hexdigest()


def checked_digest(raw: bytes, entry: dict[str, Any]) -> str | None:
    """The digest of `raw` if it matches its manifest `entry` (chunked, or the whole-file sha256
    of older manifests), else None. The chunk list must fit the size before anything is hashed,
    so a manifest cannot make the check hash in tiny pieces."""
    chunks, chunk_bytes = entry.get("chunk_sha256"), entry.get("chunk_bytes")
    if chunks is None:
        whole = hashlib.sha256(raw).hexdigest()
        return whole if whole == entry.get("sha256") else None
    if (
        not isinstance(chunks, list)
        or type(chunk_bytes) is not int
        or chunk_bytes <= 0
        or len(chunks) != -(-len(raw) // chunk_bytes)
        or entry.get("digest") != tree_digest(chunk_bytes, len(raw), chunks)
    ):
        return None
    got = file_digest(raw, chunk_bytes)
    return got.digest if got.chunks == chunks else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names whose tensor is memory already kept (tied embeddings: one tensor under two
    names), as save_pretrained does. Distinct views of one storage are distinct tensors (the
    publishing process's buffers are views of one shared block) and are all kept."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        memory = (t.data_ptr(), t.nbytes)
        if memory in seen:
            continue
        seen.add(memory)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def _read_regular(dir_fd: int, name: str, version: int) -> bytes | None:
    """The whole content of `name` in the directory `dir_fd`, opened without following a link
    (None: no such file). A link or anything but a regular file is CorruptWeights."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link
        raise CorruptWeights(
            f"weights v{version}: {name} is a symbolic link or unreadable ({e.strerror}); "
            "refusing to load"
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CorruptWeights(f"weights v{version}: {name} is not a regular file")
        return f.read()


def _write_private(dest: Path, data: bytes) -> None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class WeightStore:
    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir) / "weights"
        self.root.mkdir(parents=True, exist_ok=True)
        self._real_root = Path(os.path.realpath(self.root))  # the store may sit behind a link

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def clean_temp(self) -> int:
        """Remove what a publisher killed mid-write left (temp version dirs, a temp LATEST);
        returns how many. Call it at start, before publishing: it does not spare a live
        publisher's temp files."""
        stale = list(self.root.glob(".tmp-*")) + list(self.root.glob(".LATEST.*"))
        for d in stale:
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
        return len(stale)

    def publish(
        self,
        state: dict[str, torch.Tensor],
        version: int,
        step: int,
        adapter_config: dict[str, Any] | None = None,
        fence: Callable[[], None] = lambda: None,
    ) -> VersionInfo:
        """Write `state` as version `version`: full weights, or with `adapter_config` a PEFT
        adapter (its tensors under PEFT's names, and its adapter_config.json). `fence` runs
        right before the version becomes visible (the learner's lease check, broker/lease.py)."""
        final = self.version_dir(version)
        if final.exists():
            raise FileExistsError(f"weight version {version} already exists at {final}")
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        kind = "full" if adapter_config is None else "adapter"
        tensors = MODEL_FILE if kind == "full" else ADAPTER_FILE
        try:
            files = self._write_files(tmp, tensors, state, adapter_config)
            manifest = {
                "version": version,
                "step": step,
                "kind": kind,
                "created_at": time.time(),
                "files": files,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync_file(tmp / MANIFEST)
            _fsync_dir(tmp)
            fence()
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing of a failed version stays
            raise
        self._write_latest(version)
        _fsync_dir(self.root)
        digest = version_digest(kind, {name: entry["digest"] for name, entry in files.items()})
        return VersionInfo(version=version, path=str(final), sha256=digest, step=step, kind=kind)

    @staticmethod
    def _write_files(
        tmp: Path,
        tensors: str,
        state: dict[str, torch.Tensor],
        adapter_config: dict[str, Any] | None,
    ) -> dict[str, dict[str, Any]]:
        """Write a version's files into `tmp`, fsynced; returns their manifest entries."""
        # hashed while written (broker/safetensors_stream.py): the file is never read back
        written = write_safetensors(unique_tensors(state), tmp / tensors, {"format": "pt"})
        files = {tensors: written.manifest_entry()}
        if adapter_config is not None:
            text = json.dumps(adapter_config, indent=2, sort_keys=True).encode()
            (tmp / ADAPTER_CONFIG).write_bytes(text)
            _fsync_file(tmp / ADAPTER_CONFIG)
            files[ADAPTER_CONFIG] = file_digest(text).manifest_entry()
        return files

    def _write_latest(self, version: int) -> None:
        tmp = self.root / f".LATEST.{os.getpid()}"
        tmp.write_text(f"{version}\n")
        _fsync_file(tmp)
        os.replace(tmp, self.root / "LATEST")

    def latest(self) -> int | None:
        try:
            return int((self.root / "LATEST").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def versions(self) -> list[int]:
        """Versions that have a manifest (complete ones), ascending."""
        out = []
        for d in self.root.glob("v*"):
            if (d / MANIFEST).is_file() and d.name[1:].isdigit():
                out.append(int(d.name[1:]))
        return sorted(out)

    def verified_files(
        self, version: int, expect_sha256: str | None = None
    ) -> tuple[str, dict[str, bytes]]:
        """The kind of `version` and the bytes of each of its files, every file read once and
        checked against the manifest (size and digest of exactly these bytes), and the version's
        digest against `expect_sha256` when given. The version directory, its manifest and its
        files are opened without following symbolic links (O_NOFOLLOW, relative to the
        directory's fd), so a link, or a file swapped in after the check, is never loaded."""
        d = self.version_dir(version)
        dir_fd = self._open_version_dir(version)
        try:
            manifest = self._read_manifest(version, dir_fd)
            kind = manifest.get("kind", "full")  # manifests written before adapters: full
            entries = manifest.get("files", {})
            if (
                manifest.get("version") != version
                or kind not in KIND_FILES
                or not isinstance(entries, dict)
                or not all(isinstance(entries.get(n), dict) for n in KIND_FILES[kind])
            ):
                raise CorruptWeights(f"weights v{version}: manifest does not describe this version")
            data = {name: _read_regular(dir_fd, name, version) for name in KIND_FILES[kind]}
        finally:
            os.close(dir_fd)
        digests = {}
        for name, raw in data.items():
            if raw is None or len(raw) != entries[name].get("size"):
                raise CorruptWeights(f"weights v{version}: {name} missing or of the wrong size")
            digest = checked_digest(raw, entries[name])
            if digest is None:
                raise CorruptWeights(f"weights v{version}: sha256 mismatch, refusing to load ({d})")
            digests[name] = digest
        if expect_sha256 and version_digest(kind, digests) != expect_sha256:
            raise CorruptWeights(f"weights v{version}: sha256 mismatch, refusing to load ({d})")
        return kind, typing.cast(dict[str, bytes], data)

    def verified_bytes(self, version: int, expect_sha256: str | None = None) -> bytes:
        """The model file of a full version, read once and verified (`verified_files`)."""
        kind, data = self.verified_files(version, expect_sha256)
        if kind != "full":
            raise CorruptWeights(f"weights v{version}: an {kind} version has no {MODEL_FILE}")
        return data[MODEL_FILE]

    def verified_copy(self, version: int, dest: Path, expect_sha256: str | None = None) -> Path:
        """Write the verified bytes of `version` to `dest` (a file in a directory the caller
        owns, not the shared store) and return it: what is loaded from there is what was hashed."""
        _write_private(dest, self.verified_bytes(version, expect_sha256))
        return dest

    def verified_copy_dir(
        self, version: int, dest: Path, expect_sha256: str | None = None
    ) -> tuple[str, Path]:
        """Write the verified files of `version` into the new directory `dest` (mode 0700, in a
        directory the caller owns); returns the version's kind and `dest`."""
        kind, data = self.verified_files(version, expect_sha256)
        dest.mkdir(mode=0o700)
        for name, raw in data.items():
            _write_private(dest / name, raw)
        return kind, dest

    def verified_path(self, version: int, expect_sha256: str | None = None) -> Path:
        """The model file of `version` in the store, after `verified_bytes` has checked it. The
        file may change after this returns: a process that must load exactly what was verified
        (a generator) uses `verified_copy` instead."""
        self.verified_bytes(version, expect_sha256)
        return self.version_dir(version) / MODEL_FILE

    def _open_version_dir(self, version: int) -> int:
        d = self.version_dir(version)
        if d.is_symlink() or (d.exists() and Path(os.path.realpath(d)).parent != self._real_root):
            raise CorruptWeights(
                f"weights v{version}: {d} is a link or lies outside the weight store "
                f"{self.root}; refusing to load"
            )
        try:
            return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CorruptWeights(f"weights v{version}: no manifest in {d}") from None
        except OSError as e:  # ELOOP / ENOTDIR: replaced by a link or a file since the check
            raise CorruptWeights(f"weights v{version}: {d} is not a directory ({e})") from None

    def _read_manifest(self, version: int, dir_fd: int) -> dict:
        d = self.version_dir(version)
        raw = _read_regular(dir_fd, MANIFEST, version)
        if raw is None:
            raise CorruptWeights(f"weights v{version}: no manifest in {d}")
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CorruptWeights(f"weights v{version}: unreadable manifest in {d}") from None
        if not isinstance(manifest, dict):
            raise CorruptWeights(f"weights v{version}: unreadable manifest in {d}")
        return manifest

    def retain(self, keep: int, in_use: set[int]) -> list[int]:
        """Delete all but the newest `keep` versions, sparing those in `in_use`; returns deleted."""
        versions = self.versions()
        doomed = [v for v in versions[:-keep] if v not in in_use] if keep > 0 else []
        for v in doomed:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)
        return doomed
