"""deploy/Dockerfile, checked offline: this machine cannot pull a base image, so the image is
not built here. hadolint (the `lint` extra) lints it, and what the recipes rely on is read from
it: every role folder the package installs is copied in (setup.cfg's package_dir) and let
through the build context's ignore file, the `vllm` extra is installed, nothing downloads at
run time, and it does not run as root."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _hadolint() -> str:
    """The venv's hadolint (the lint extra), else one on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (the lint extra: pip install -e '.[lint]')")
    return found


def test_hadolint_passes_and_catches_a_bad_instruction(tmp_path):
    hadolint = _hadolint()
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 1000:1000", "USER root"))
    out = subprocess.run([hadolint, str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3002" in out.stdout  # the last USER should not be root


def test_the_image_holds_every_role_folder_and_the_vllm_extra():
    text = DOCKERFILE.read_text()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    folders = ["rollflash"] + [
        line.split("=")[1].strip() for line in cfg["options"]["package_dir"].strip().splitlines()
    ]
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    for folder in folders:
        assert f"COPY {folder}/ {folder}/" in text, folder
        assert f"!{folder}/" in ignore, folder
    assert 'pip install ".[vllm,' in text
    assert "HF_HUB_OFFLINE=1" in text and "HF_DATASETS_OFFLINE=1" in text
    for program in ("redis-server", "redis-tools", "bubblewrap"):
        assert program in text
