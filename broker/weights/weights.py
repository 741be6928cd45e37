"""The versioned weight store.

Layout: `{run_dir}/weights/v{version:08d}/` holds `manifest.json` (version, step, kind, files with
sizes and chunked digests: broker/weights/manifest.py) and the files of its kind: `full` =
`model.safetensors` (every weight), `adapter` = `adapter_model.safetensors` +
`adapter_config.json` (a standard PEFT LoRA adapter for the base at `model.path`,
`learner/models/lora.py`). `{run_dir}/weights/LATEST` names the newest version. The learner's store is
read by generators on the same filesystem, or served over HTTP (broker/weights/weight_server.py); a
generator fetching over HTTP keeps a store of its own with the same layout.

Invariants a reader can rely on:
- A version directory appears by one atomic rename of a fully written and fsynced temp directory,
  and its manifest is the last file written inside it: a reader never sees a half-written version.
- `open_version(v)` opens the version directory, its manifest and its files without following
  symbolic links (O_NOFOLLOW, relative to the directory's descriptor), refuses anything outside
  the store, checks the manifest (and the version's digest against the announced one) and each
  file's size: a reader then reads those descriptors chunk by chunk and checks every chunk before
  it uses it (broker/weights/weight_stream.py), so a truncated, bit-flipped or swapped file is refused
  with `CorruptWeights`, and a file replaced after it was opened is never read. Adapter versions
  follow the same rules and the same retention as full ones.
- Retention deletes old versions but never one that a caller says is still in use.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflash.broker.connect.secrets import make_private_dir
from rollflash.broker.weights.digest import file_digest
from rollflash.broker.weights.manifest import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    KIND_FILES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MODEL_FILE,
    CorruptWeights,
    Manifest,
    parse_manifest,
    version_digest,
)
from rollflash.broker.weights.safetensors_stream import METADATA, write_safetensors

if TYPE_CHECKING:
    from rollflash.broker.weights.delta_write import VersionChain

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "KIND_FILES",
    "MANIFEST",
    "MODEL_FILE",
    "CorruptWeights",
    "OpenVersion",
    "VersionInfo",
    "WeightStore",
    "unique_tensors",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionInfo:
    version: int
    path: str  # the version directory
    sha256: str  # the version's digest: model.safetensors' digest, or an adapter's listing's
    step: int
    kind: str = "full"  # or "adapter"


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


def _open_regular(dir_fd: int, name: str, version: int) -> int | None:
    """A descriptor of `name` in the directory `dir_fd`, opened without following a link (None:
    no such file). A link or anything but a regular file is CorruptWeights."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link
        raise CorruptWeights(
            f"weights v{version}: {name} is a symbolic link or unreadable ({e.strerror}); "
            "refusing to load"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptWeights(f"weights v{version}: {name} is not a regular file")
    return fd


@dataclass
class OpenVersion:
    """A version's checked manifest and a descriptor of each of its files (`close` them)."""

    manifest: Manifest
    fds: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class WeightStore:
    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir) / "weights"
        make_private_dir(self.root)  # readers open it too: no check of who owns it
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
        chain: VersionChain | None = None,
    ) -> VersionInfo:
        """Write `state` as version `version`: full weights, or with `adapter_config` a PEFT
        adapter (its tensors under PEFT's names, and its adapter_config.json); with `chain`
        (full weights only) as a delta against the version before, a full anchor, or both
        (broker/weights/delta_write.py). `fence` runs right before the version becomes visible (the
        learner's lease check, broker/channels/lease.py)."""
        final = self.version_dir(version)
        if final.exists():
            raise FileExistsError(f"weight version {version} already exists at {final}")
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        kind = "full" if adapter_config is None else "adapter"
        extra: dict[str, Any] = {}
        try:
            if chain is not None and kind == "full":
                kind, files, extra = chain.write(tmp, unique_tensors(state), version)
            else:
                tensors = MODEL_FILE if kind == "full" else ADAPTER_FILE
                files = self._write_files(tmp, tensors, state, adapter_config)
            manifest = {
                "version": version,
                "step": step,
                "kind": kind,
                "created_at": time.time(),
                "files": files,
                **extra,
            }
            raw = json.dumps(manifest, indent=1).encode()
            (tmp / MANIFEST).write_bytes(raw)
            _fsync_file(tmp / MANIFEST)
            _fsync_dir(tmp)
            fence()
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing of a failed version stays
            raise
        self._write_latest(version)
        _fsync_dir(self.root)
        digests = {name: entry["digest"] for name, entry in files.items()}
        digest = version_digest(kind, digests, raw if extra else None)
        if chain is not None and kind != "adapter":
            chain.published(version, digest)
        return VersionInfo(version=version, path=str(final), sha256=digest, step=step, kind=kind)

    @staticmethod
    def _write_files(
        tmp: Path,
        tensors: str,
        state: dict[str, torch.Tensor],
        adapter_config: dict[str, Any] | None,
    ) -> dict[str, dict[str, Any]]:
        """Write a version's files into `tmp`, fsynced; returns their manifest entries."""
        # hashed while written (broker/weights/safetensors_stream.py): the file is never read back
        written = write_safetensors(unique_tensors(state), tmp / tensors, METADATA)
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

    def open_version(
        self, version: int, expect_sha256: str | None = None, form: str | None = None
    ) -> OpenVersion:
        """The version's manifest, checked (against `expect_sha256`, the announced digest, when
        given), and its files opened without following links, each of the manifest's size:
        those of `form` (broker/weights/manifest.py `Manifest.forms`), or all of them."""
        dir_fd = self._open_version_dir(version)
        opened = None
        try:
            opened = OpenVersion(self._read_manifest(version, dir_fd, expect_sha256))
            names = opened.manifest.files if form is None else opened.manifest.form_files(form)
            for name in names:
                spec = opened.manifest.files[name]
                fd = _open_regular(dir_fd, name, version)
                if fd is None:
                    raise CorruptWeights(f"weights v{version}: {name} missing")
                opened.fds[name] = fd
                size = os.fstat(fd).st_size
                if size != spec.size:
                    raise CorruptWeights(
                        f"weights v{version}: {name} is {size} bytes, its manifest says "
                        f"{spec.size} (truncated or replaced); refusing to load"
                    )
            return opened
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        finally:
            os.close(dir_fd)

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

    def _read_manifest(self, version: int, dir_fd: int, expect_sha256: str | None) -> Manifest:
        fd = _open_regular(dir_fd, MANIFEST, version)
        if fd is None:
            raise CorruptWeights(f"weights v{version}: no manifest in {self.version_dir(version)}")
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        return parse_manifest(raw, version, expect_sha256)

    def manifest(self, version: int, expect_sha256: str | None = None) -> Manifest:
        """The version's checked manifest (`open_version` without opening the files)."""
        dir_fd = self._open_version_dir(version)
        try:
            return self._read_manifest(version, dir_fd, expect_sha256)
        finally:
            os.close(dir_fd)

    def retain(self, keep: int, in_use: set[int]) -> list[int]:
        """Delete all but the newest `keep` versions and the chain of deltas they stand on (back
        to a full version: what a generator that joins needs to rebuild them), sparing those in
        `in_use`; returns deleted."""
        versions = self.versions()
        if keep <= 0 or len(versions) <= keep:
            return []
        oldest = len(versions) - keep
        while (
            oldest > 0
            and versions[oldest - 1] == versions[oldest] - 1
            and self._is_delta(versions[oldest])
        ):
            oldest -= 1
        doomed = [v for v in versions[:oldest] if v not in in_use]
        for v in doomed:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)
        return doomed

    def _is_delta(self, version: int) -> bool:
        """Whether `version` can only be read as a delta (a damaged one counts as not)."""
        try:
            return self.manifest(version).kind == "delta"
        except CorruptWeights:
            return False
