"""The versioned weight store on a shared filesystem.

Layout: `{run_dir}/weights/v{version:08d}/` holds `model.safetensors` and `manifest.json`
(version, step, files with sizes and sha256). `{run_dir}/weights/LATEST` names the newest version.

Invariants a reader can rely on:
- A version directory appears by one atomic rename of a fully written and fsynced temp directory,
  and its manifest is the last file written inside it: a reader never sees a half-written version.
- `verified_bytes(v)` reads the model file once and checks the size and sha256 of those bytes
  against the manifest, so a truncated or bit-flipped file is refused with `CorruptWeights`; a
  generator loads a private copy of exactly those bytes (`verified_copy`), so a file swapped in the
  store after the check is never loaded. Symbolic links (a version directory, its manifest or its
  model file) and anything outside the store are refused, never followed.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from rollflash.broker.safetensors_stream import write_safetensors

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"


class CorruptWeights(RuntimeError):
    """A version whose files do not match its manifest (or that has no manifest)."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    path: str  # the version directory
    sha256: str  # of model.safetensors
    step: int


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
    """Drop names that alias storage already kept (tied embeddings), as save_pretrained does."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
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

    def publish(self, state: dict[str, torch.Tensor], version: int, step: int) -> VersionInfo:
        final = self.version_dir(version)
        if final.exists():
            raise FileExistsError(f"weight version {version} already exists at {final}")
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model_path = tmp / MODEL_FILE
        # hashed while written (broker/safetensors_stream.py): the file is never read back
        size, digest = write_safetensors(unique_tensors(state), model_path, {"format": "pt"})
        manifest = {
            "version": version,
            "step": step,
            "created_at": time.time(),
            "files": {MODEL_FILE: {"size": size, "sha256": digest}},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        self._write_latest(version)
        _fsync_dir(self.root)
        return VersionInfo(version=version, path=str(final), sha256=digest, step=step)

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

    def verified_bytes(self, version: int, expect_sha256: str | None = None) -> bytes:
        """The model file of `version`, read once and checked against its manifest (size and
        sha256 of exactly these bytes). The version directory, its manifest and the model file are
        opened without following symbolic links (O_NOFOLLOW, relative to the directory's fd), so
        a link, or a file swapped in after the check, is never what a caller loads."""
        d = self.version_dir(version)
        dir_fd = self._open_version_dir(version)
        try:
            manifest = self._read_manifest(version, dir_fd)
            entry = manifest.get("files", {}).get(MODEL_FILE)
            if manifest.get("version") != version or not isinstance(entry, dict):
                raise CorruptWeights(f"weights v{version}: manifest does not describe this version")
            data = _read_regular(dir_fd, MODEL_FILE, version)
        finally:
            os.close(dir_fd)
        if data is None or len(data) != entry.get("size"):
            raise CorruptWeights(f"weights v{version}: {MODEL_FILE} missing or of the wrong size")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.get("sha256") or (expect_sha256 and digest != expect_sha256):
            raise CorruptWeights(f"weights v{version}: sha256 mismatch, refusing to load ({d})")
        return data

    def verified_copy(self, version: int, dest: Path, expect_sha256: str | None = None) -> Path:
        """Write the verified bytes of `version` to `dest` (a file in a directory the caller
        owns, not the shared store) and return it: what is loaded from there is what was hashed."""
        data = self.verified_bytes(version, expect_sha256)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return dest

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
