"""Loading one split of a dataset source as a memory-mapped `datasets.Dataset` (envs/dataset.py).

A source is a JSONL / JSON / parquet / CSV file, a directory written by `save_to_disk`, a
directory of data files, or a Hugging Face dataset id read from the local cache. A path that can
only be local (`looks_local`) and is not there is reported as missing, never looked up on the hub.
Every line of a JSON or CSV file is checked before a reader sees it (envs/rows.py `check_files`).
"""

from __future__ import annotations

from pathlib import Path

from rollflash.envs.rows import check_files, unreadable
from rollflash.errors import BadInput, MissingFile

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_ROW_BYTES = 16 << 20  # the default of task.params.max_row_bytes


def _offline_hint(source: str, e: Exception) -> ValueError:
    return BadInput(
        f"task.params.path: {source!r} is not a local file or directory and no copy of that hub "
        f"dataset is in the Hugging Face cache ({e.__class__.__name__}); on a machine with "
        f"network run `python -c \"import datasets; datasets.load_dataset('{source}')\"` (or "
        "copy the files and point path at them)"
    )


def looks_local(source: str) -> bool:
    """Whether `source` can only mean a path on this machine: it starts with `/`, `./`, `../`
    or `~`, or ends with a data file's extension. Such a path that is not there is reported as
    missing, never looked up as a hub dataset id."""
    return source.startswith(("/", "./", "../", "~")) or Path(source).suffix.lower() in BUILDERS


def load_source(
    source: str,
    split: str,
    name: str | None = None,
    cache_dir: str | None = None,
    key: str = "task.params.path",
    max_row_bytes: int = MAX_ROW_BYTES,
):
    """One split of `source` as a memory-mapped `datasets.Dataset`; `key` names it in errors. Its
    JSON and CSV files are checked first (envs/rows.py `check_file`)."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source)
    check_files(source, path, max_row_bytes)
    saved = any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
    if path.is_dir() and saved:
        ds = datasets.load_from_disk(str(path))
    elif path.is_file():
        builder = BUILDERS.get("".join(path.suffixes[-1:]).lower())
        if builder is None:
            raise BadInput(
                f"{key}: {path} is not .jsonl, .json, .parquet or .csv "
                "(or a directory written by save_to_disk)"
            )
        if is_blank(path):
            raise BadInput(f"{source}: empty, no rows")
        try:
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache_dir
            )
        except Exception as e:  # whatever the reader raises: one line naming the file
            raise unreadable(source, path, e) from None
    elif path.is_dir():
        ds = datasets.load_dataset(str(path), name, cache_dir=cache_dir)
    elif looks_local(source):
        raise MissingFile(f"{key}: no such file or directory: {source}")
    else:
        try:
            ds = datasets.load_dataset(source, name, cache_dir=cache_dir)
        except Exception as e:  # offline and not cached: ConnectionError, FileNotFoundError, ...
            raise _offline_hint(source, e) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise BadInput(
                f"task.params.split: {source} has no split {split!r} (splits: {', '.join(ds)})"
            )
        ds = ds[split]
    return ds


def is_blank(path: Path) -> bool:
    """True if a text file holds only whitespace (`datasets` fails on it with StopIteration)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True
