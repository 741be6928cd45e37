"""`model.path`: a local model directory, or a Hugging Face hub id read from the local hub cache.

Every process of a run (learner, generators, export) turns `model.path` into a directory with
`model_directory` before it loads anything:

- a directory holding `config.json` is used as it is;
- otherwise a name shaped like a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) is looked up in the
  Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
  the standard layout `models--org--name/snapshots/<revision>/`, revision from `refs/main`) with
  `huggingface_hub.snapshot_download(local_files_only=True)`: no network, whatever
  `HF_HUB_OFFLINE` says.

Before a run starts anything, `check_model_files` also checks that the directory holds a tokenizer
and its weights (every shard a weights index names), so that a broken model directory is one line
in a second rather than an error in every process (rollctl/preflight.py).

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
from typing import Any

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


# any one of these makes a tokenizer transformers can load (tokenizer_config.json alone: a
# tokenizer class that needs no vocabulary file)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer_config.json",
)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_files(path: str, key: str = "model.path") -> Path:
    """`model_directory(path)`, after checking that it holds a tokenizer and weights (every shard
    a weights index names): what can be checked in a moment before a run starts loading it
    (rollctl/preflight.py). MissingFile in one line naming `key` and the directory."""
    import json

    directory = model_directory(path, key)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise MissingFile(
            f"{key}: no tokenizer in {directory} (none of {', '.join(TOKENIZER_FILES)})"
        )
    index = next((directory / i for i in WEIGHT_INDEXES if (directory / i).is_file()), None)
    if index is None:
        if not any((directory / f).is_file() for f in WEIGHT_FILES):
            raise MissingFile(
                f"{key}: no weights in {directory} (none of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})"
            )
        return directory
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MissingFile(
            f"{key}: {index} is not a weights index ({e.__class__.__name__})"
        ) from None
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise MissingFile(
            f"{key}: {index.name} in {directory} names {missing[0]}, which is not there "
            f"({len(missing)} of {len(shards)} shards missing)"
        )
    return directory


def tokenizer_if_present(path: str, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer of the model directory `path` names (`model_directory`), or None when it
    names none: how the simulated engine and the simulated learner, which load no model, agree
    on prompt ids (envs/chat.py `prompt_encoder`). transformers is imported only then."""
    try:
        directory = model_directory(path)
    except MissingFile:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
