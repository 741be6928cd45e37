"""One of two gloo ranks for tests/integration/test_dist_timeout.py, started with the variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Both ranks build the
learner's model through learner/build.py as `rollctl start-learner` does, with
`trainer.dist_timeout_s` = TIMEOUT; then rank 1 stalls (SIGSTOP, as a rank stopped by a debugger
or a hung kernel) and rank 0 runs a training step, whose first collective waits for it. Rank 0
prints one JSON line (the error's type and message and the seconds the step waited) and
exits.

    python stall_worker.py MODEL TIMEOUT
"""

import json
import os
import signal
import sys
import time

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.process.dist import init_dist
from rollflash.learner.step.train import train_step
from tests.integration.dist_worker import make_groups


def main(model_dir: str, timeout_s: float) -> None:
    cfg = config_from_dict(
        {
            "model": {"path": model_dir},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {"device": "cpu", "strategy": "fsdp", "dist_timeout_s": timeout_s},
        }
    )
    dist = init_dist(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    models = build_models(cfg, dist)
    optim = build_optim(cfg, models)
    groups = make_groups(models.tokenizer, 2)
    dist.barrier()  # both ranks are built: the stall below is the only one
    if dist.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        train_step(models.model, optim.optimizer, groups, cfg, models.algo, dist)
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        waited = time.monotonic() - started
        print(json.dumps({"type": type(e).__name__, "error": str(e), "waited_s": waited}))
        raise SystemExit(1) from None  # and the rank's teardown must not wait for the peer
    print(json.dumps({"type": None}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
