"""`make gpu-wheels`: download the wheels the GPU check needs beyond the GPU test machine's
packages (docs/gpu.md) into an ignored folder that travels with the checkout (.whl/, 3 MB).

The check's imports need pydantic (the config), which the machine lacks; pydantic needs
pydantic-core, annotated-types, typing-inspection and a recent typing-extensions. They are
downloaded at the versions this environment has installed, the ones the tests ran with, as
binary wheels for CPython `--python-version` on manylinux x86_64 (no dependencies resolved: the
list is the closure). On the machine, scripts/gpu_check.py unpacks them onto its path itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pins() -> list[str]:
    """NAME==VERSION of every wheel, as installed here."""
    return [f"{name}=={md.version(name)}" for name in WHEELS]


def download(python_version: str, dest: Path) -> list[Path]:
    """The wheels in `dest`, downloaded unless the same pins for the same Python are there
    already (`dest/PINS` records them); returns their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    record = dest / "PINS"
    wanted = "\n".join([f"python {python_version}", *pins()]) + "\n"
    if record.is_file() and record.read_text() == wanted:
        return sorted(dest.glob("*.whl"))
    for old in dest.glob("*.whl"):
        old.unlink()
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "-d", str(dest), *pins()],
        check=True,
    )  # fmt: skip
    record.write_text(wanted)
    return sorted(dest.glob("*.whl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument("--dest", default=".whl", type=Path)
    args = p.parse_args()
    for wheel in download(args.python_version, args.dest):
        print(wheel)


if __name__ == "__main__":
    main()
