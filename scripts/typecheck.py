"""Run mypy over every product folder, by the module names the package is installed under.

setup.cfg's `package_dir` installs the top-level role folders as `rollflash.<folder>`
(`rollflash.learner` is `learner/`). mypy's own file discovery names a file by the folders above
it (`learner/loop.py` would be `learner.loop`), so every `from rollflash.broker import ...` would
look unresolved. This script reads the same mapping from setup.cfg, hands mypy each file with its
installed module name (mypy's build API takes a module name per file), and reads mypy's options
from setup.cfg's `[mypy]` section. Prints mypy's messages and exits 1 if there are errors.

    .venv/bin/python scripts/typecheck.py     # part of `make lint`
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: scripts/import_graph.py reads the same mapping
from scripts.import_graph import PACKAGE, modules, package_dirs  # noqa: E402


def sources(dirs: dict[str, Path]) -> list[BuildSource]:
    """Every .py file below each mapped folder, with its installed module name."""
    return [BuildSource(str(path.relative_to(ROOT)), name) for name, path in modules(dirs).items()]


def main() -> int:
    os.chdir(ROOT)  # mypy's messages name files relative to the repository, and its cache is here
    setup_cfg = ROOT / "setup.cfg"
    _, options = process_options(["--config-file", str(setup_cfg), PACKAGE])
    result = build.build(sources(package_dirs(setup_cfg)), options)
    for message in result.errors:
        print(message)
    errors = sum(": error:" in message for message in result.errors)
    if errors:
        print(f"mypy: {errors} errors", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
