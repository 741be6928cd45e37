"""Starting several learner ranks: `rollctl start-learner --nproc N` re-runs itself under torchrun.

torchrun (torch.distributed.run) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
for every rank; a rank sees LOCAL_RANK and runs the learner instead of launching again. One node
uses torchrun's standalone rendezvous; several nodes pass `--nnodes` and `--rdzv-endpoint`, as
with torchrun itself.
"""

from __future__ import annotations

import sys

from rollflash.errors import BadInput


def torchrun_argv(
    nproc: int, nnodes: int, rdzv_endpoint: str | None, cli_args: list[str]
) -> list[str]:
    """The command line that runs `rollctl <cli_args>` as `nproc` ranks on this node."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise BadInput("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        argv += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        argv += ["--standalone"]
    return argv + ["-m", "rollflash.rollctl.cli", *cli_args]
