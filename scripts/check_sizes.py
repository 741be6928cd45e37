"""Fail when a source file outside tests/ is over 400 lines or a function is over 60 lines.

The house limits of STYLE.md: a file that long holds more than one role, a function that long
more than one step. Run by `make lint`; prints one line per offender and exits 1 if any.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def offenders(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{path}: {lines} lines (max {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{path}:{node.lineno}: {node.name}() is {length} lines "
                    f"(max {MAX_FUNCTION_LINES})"
                )
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="files to check (default: git's tracked *.py)")
    args = p.parse_args()
    paths = (
        args.paths
        or subprocess.run(
            ["git", "ls-files", "*.py"], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    found = [o for f in paths if not f.startswith("tests/") for o in offenders(Path(f))]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
