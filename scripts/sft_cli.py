"""The command-line options the model-building scripts share (make_tiny_model.py,
make_mixture_model.py, make_rg_model.py, make_tiny_agent_model.py), and how they print."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

MAX_POSITIONS = 64  # the default context of make_tiny_model.py's models


def shape_args(p: argparse.ArgumentParser, hidden: int = 128, max_positions: int = MAX_POSITIONS):
    """The model-shape options of the scripts that build a model from scratch."""
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden", type=int, default=hidden, help="hidden size (MLP is 4x)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (= key/value heads)")
    p.add_argument("--max-positions", type=int, default=max_positions, help="context length")


def sft_parser(doc: str, steps: int, lr: float, teacher_error: float) -> argparse.ArgumentParser:
    """The options of make_tiny_model.py, make_mixture_model.py and make_rg_model.py: where to write,
    the SFT schedule and teacher, the seed, torch threads and --no-eval."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument(
        "--sft-steps", type=int, default=steps, help="SFT optimiser steps (0 = untrained)"
    )
    p.add_argument("--sft-lr", type=float, default=lr, help="peak SFT learning rate")
    p.add_argument(
        "--sft-teacher-error",
        type=float,
        default=teacher_error,
        help="probability that an SFT target is the near miss instead of the answer (sft_items)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds new weights, the stream, the teacher")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 because these matrices are too small to gain from more, "
        "and on a busy machine a second thread spins waiting for a taken core",
    )
    p.add_argument("--no-eval", dest="eval", action="store_false", help="skip held-out evaluation")
    return p


def parse_sft_args(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if not 0.0 <= args.sft_teacher_error < 1.0:
        p.error(f"--sft-teacher-error must be in [0, 1), got {args.sft_teacher_error}")
    return args


def run_script(build: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace):
    """Build, and print the summary as one JSON line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(build(args)), flush=True)
