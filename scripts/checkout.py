"""Import this checkout's `rollflash` whether or not it is installed.

`pip install -e .` maps `rollflash.<folder>` onto the role folders (setup.cfg `package_dir`); on
a machine where only the repository's files are (the GPU test machine, docs/gpu.md) the same
mapping is made here: `rollflash` is this checkout's rollflash/ package, and its search path
also holds the checkout's root, where the role folders are. A script calls `use_checkout()`
before its first `rollflash` import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    if importlib.util.find_spec("rollflash") is not None:
        return  # installed (editable or not): its own mapping holds
    sys.path.insert(0, str(ROOT))
    import rollflash

    rollflash.__path__.append(str(ROOT))
