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

import configparser
import os
import sys
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "rollflash"


def package_dirs(setup_cfg: Path) -> dict[str, Path]:
    """`rollflash.<folder>` -> its folder, as setup.cfg's `package_dir` maps them."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    dirs = {PACKAGE: ROOT / PACKAGE}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        module, _, folder = (part.strip() for part in line.partition("="))
        dirs[module] = ROOT / folder
    return dirs


def sources(dirs: dict[str, Path]) -> list[BuildSource]:
    """Every .py file below each mapped folder, with its installed module name."""
    found = []
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append(BuildSource(str(path.relative_to(ROOT)), ".".join([package, *parts])))
    return found


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
