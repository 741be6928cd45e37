"""`rollctl --help` must stay instant: the CLI module may not import torch, transformers or vllm."""

import subprocess
import sys


def test_cli_import_pulls_no_heavy_modules():
    code = (
        "import sys, rollflash.rollctl.cli; heavy = [m for m in ('torch', 'transformers', 'vllm', "
        "'safetensors.torch') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
