"""Warm-start a tiny model on a run config's mixture of tasks (configs/mixture.yaml).

It continues from a model scripts/make_tiny_model.py built (`--base`, the demo's: addition already
learnt from an off-by-one teacher), keeps its tokenizer as it is, and runs the same SFT
(`make_tiny_model.sft`) on the config's task, here addition mixed with the one-liners of
envs/oneliner.py, with a teacher wrong with probability `--sft-teacher-error` in each domain
(`near_miss`): a sum off by one, or the program with a and b swapped, which passes the test x = 1
only. So greedy decoding mostly writes the near miss and sampling the right answer about a third
of the time in both domains, the room GRPO needs (docs/tasks.md, "Mixtures").

Starting from the demo's model rather than from scratch halves the SFT: the one-liners then take
600 steps (copying a and b into the program), addition is kept. Prints one JSON line:
    {"sft_steps": ..., "sft_loss": ..., "sft_wall_s": ..., "heldout_acc": {domain: ...}, "out": ...}

    python scripts/make_mixture_model.py --base models/tiny --config configs/mixture.yaml \\
        --out models/tiny-mixture --sft-steps 600 --sft-lr 2e-3 --sft-teacher-error 0.6
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoTokenizer, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflash.envs import make_task  # noqa: E402
from rollflash.envs.oneliner import program  # noqa: E402
from scripts.make_tiny_model import (  # noqa: E402
    items_accuracy,
    sft,
    sft_config,
)
from scripts.sft_cli import parse_sft_args, run_script, sft_parser  # noqa: E402

logger = logging.getLogger(__name__)

_ONELINER = re.compile(r"print\(int\(input\(\)\)\*(\d+)\+(\d+)\)")  # envs/oneliner.py's program


def near_miss(answer: str) -> str:
    """The teacher's wrong answer: a one-liner with a and b swapped, an integer plus one."""
    match = _ONELINER.fullmatch(answer)
    if match:
        return program(int(match[2]), int(match[1]))
    return str(int(answer) + 1)


def make_mixture_model(args: argparse.Namespace) -> dict[str, Any]:
    """Load the base model, SFT it on the config's task, save; returns the summary."""
    torch.set_num_threads(args.threads)
    spec = yaml.safe_load(Path(args.config).read_text())["task"]
    task = make_task(spec["name"], spec.get("params"))
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = Qwen2ForCausalLM.from_pretrained(args.base)
    cfg = sft_config(args, mistake=near_miss)
    started = time.perf_counter()
    steps, loss = sft(model, tokenizer, task, cfg)
    wall = time.perf_counter() - started
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    acc = {}
    for domain in getattr(task, "components", []) if args.eval else []:
        items = domain.task.heldout_items()
        acc[domain.name] = items_accuracy(model, tokenizer, items)
    return {
        "sft_steps": steps,
        "sft_loss": round(loss, 4),
        "sft_wall_s": round(wall, 2),
        "heldout_acc": acc or None,
        "out": str(out),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = sft_parser(__doc__, steps=600, lr=2e-3, teacher_error=0.6)
    p.add_argument("--base", required=True, help="model directory of make_tiny_model.py")
    p.add_argument("--config", required=True, help="run config whose `task:` to learn")
    return parse_sft_args(p, argv)


def main(argv: Sequence[str] | None = None) -> None:
    run_script(make_mixture_model, parse_args(argv))


if __name__ == "__main__":
    main()
