"""`model.path`: a local model directory, or a Hugging Face hub id read from the local hub cache.

Every process of a run (learner, generators, export) turns `model.path` into a directory with
`model_directory` before it loads anything:

- a directory holding `config.json` is used as it is;
- otherwise a name shaped like a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) is looked up in the
  Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
  the standard layout `models--org--name/snapshots/<revision>/`, revision from `refs/main`) with
  `huggingface_hub.snapshot_download(local_files_only=True)`: no network, whatever
  `HF_HUB_OFFLINE` says.

Nothing is ever downloaded here: a run starts several processes that must load identical files,
and a download racing in each of them (or a hub revision moving between their starts) would break
that. When the model is in neither place, one line says what to run:
`model.path: no model directory at Qwen/Qwen2.5-0.5B-Instruct and no copy of that hub model in
the Hugging Face cache (...); download it first: huggingface-cli download Qwen/...`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rollflash.errors import MissingFile

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_cache() -> Path:
    """The hub cache directory, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def model_directory(path: str, key: str = "model.path") -> Path:
    """The local directory of `path` (module docstring); FileNotFoundError in one line naming
    `key` and the command that fetches the model."""
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return local
    if local.exists() or not _HUB_ID.match(path) or ".." in path:
        raise MissingFile(
            f"{key}: no Hugging Face model directory at {path} (no config.json there)"
        )
    cache = hub_cache()
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(path, local_files_only=True, cache_dir=cache))
    except Exception as e:  # LocalEntryNotFoundError, or a malformed cache entry
        raise MissingFile(
            f"{key}: no model directory at {path} and no copy of that hub model in the Hugging "
            f"Face cache ({cache}; {e.__class__.__name__}); download it first: "
            f"huggingface-cli download {path} (or build a local one with "
            "scripts/make_tiny_model.py)"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise MissingFile(
            f"{key}: the cached copy of {path} at {snapshot} has no config.json; download it "
            f"again: huggingface-cli download {path}"
        )
    return snapshot
