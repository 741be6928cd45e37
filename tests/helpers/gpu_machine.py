"""A Python environment with only what the GPU test machine has (docs/gpu.md), for the
portability test of the GPU check (tests/e2e/test_gpu_check.py).

The machine has these distributions, with their own requirements, and nothing else: no
pydantic, redis, pyzmq or vLLM, and not this project. `build(root)` makes a virtual environment
(no pip in it) whose site-packages holds links to exactly those distributions as the running
interpreter has them installed (the same versions as the suite: torch's CPU build here), found
through their metadata: each distribution's top-level modules and its .dist-info. It is built
once under `root` and reused (a file lock keeps parallel test workers from building it twice).
"""

from __future__ import annotations

import fcntl
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

# the GPU machine's package list (docs/gpu.md)
GPU_MACHINE = (
    "torch", "transformers", "safetensors", "tokenizers", "accelerate", "peft", "msgpack",
    "numpy", "pyyaml", "typer", "rich",
)  # fmt: skip
# what the machine lacks and the check must not need (or must carry as wheels)
ABSENT = ("pydantic", "pydantic-core", "redis", "pyzmq", "vllm", "rollflash")


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]


def closure(names: tuple[str, ...] = GPU_MACHINE) -> list[md.Distribution]:
    """The distributions `names` need, their requirements without extras, recursively."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = md.distribution(name).metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        dist = md.distribution(name)
        seen[key] = dist
        for req in dist.requires or []:
            if "extra ==" in req or "extra==" in req:
                continue
            marker = req.partition(";")[2].strip()
            if marker and not _marker_holds(marker):
                continue
            if _name(req).lower().replace("_", "-") in ABSENT:
                continue  # the machine has none (this typer asks for pydantic; its does not)
            try:
                md.distribution(_name(req))
            except md.PackageNotFoundError:
                continue  # an optional platform package torch's CPU build goes without
            todo.append(_name(req))
    return list(seen.values())


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def _top_levels(dist: md.Distribution) -> set[str]:
    """The first path components of a distribution's files: its packages, modules and
    .dist-info (and .libs folders of compiled wheels); scripts outside site-packages are left out."""
    tops = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        tops.add(first)
    return tops


def build(root: Path) -> Path:
    """The environment's python (built under `root` once)."""
    python = root / "venv" / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "venv" / ".ready").is_file():
            return python
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--clear", str(root / "venv")],
            check=True,
        )
        site = next((root / "venv" / "lib").glob("python*/site-packages"))
        dists = closure()
        names = {d.metadata["Name"].lower().replace("_", "-") for d in dists}
        for dist in dists:
            where = Path(str(dist.locate_file("")))
            for top in _top_levels(dist):
                target = site / top
                if not target.exists() and (where / top).exists():
                    target.symlink_to(where / top)
        (root / "venv" / ".ready").write_text("\n".join(sorted(names)) + "\n")
    return python
