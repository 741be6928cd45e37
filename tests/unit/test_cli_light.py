"""`rollctl --help`, `rollctl status` and `rollctl acl` must stay instant: the CLI module, the config
loader, the status, run-finding and ACL modules, and `import rollflash` may not import torch,
transformers, vllm or algos."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm", "safetensors.torch", "rollflash.algos")


@pytest.mark.parametrize(
    "module",
    [
        "rollflash.rollctl.cli",
        "rollflash.broker.config.config",
        "rollflash.broker.config.config_reference",
        "rollflash.rollctl.status",
        "rollflash.broker.connect.acl",
        "rollflash.rollctl.find",
        "rollflash.rollctl.operate",
    ],
)
def test_light_modules_pull_no_heavy_modules(module):
    code = (
        f"import sys, {module}; heavy = [m for m in {HEAVY!r} if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_loading_every_shipped_config_pulls_no_heavy_modules():
    code = (
        "import sys, pathlib; from rollflash.broker.config.config import load_config; "
        "[load_config(p) for p in pathlib.Path('configs').glob('*.yaml')]; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == ""
