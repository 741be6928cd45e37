"""Process set-up shared by every process of a run: logging, seeding and thread counts.

Nothing here runs at import time; each process entry point calls `setup_process` once.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys


def setup_process(name: str, seed: int, torch_threads: int = 0, level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    random.seed(seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch

    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)


def freeze_heap() -> None:
    """Collect, then move every object the process holds to the collector's permanent
    generation (`gc.freeze`). Call it once start-up is done (model, tokenizer, engine, clients
    built): a full collection otherwise walks all of them again, every few hundred steps a
    learner or a generator stops for ~0.2 s (tiny demo model, this CPU); afterwards it walks
    only what was allocated since. Garbage made later is still collected."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_heap` before the process ends, so that the objects it froze are collected as
    usual: a frozen cycle outlived the interpreter's last collection, and a process group's C++
    threads were then torn down unjoined at exit (SIGABRT, "terminate called without an active
    exception", seen once on an FSDP learner rank)."""
    gc.unfreeze()
    gc.collect()
