"""Two gloo ranks for tests/integration/test_fsdp_eval.py, under torchrun: the policy is built
sharded (FSDP2) by learner/build.py's `build_models` and the task as `start` builds it, then both
ranks run the held-out greedy evaluation as `Learner.evaluate` does with FSDP (every rank, with
the ranks), on the held-out items INDICES, two prompts per `generate` call. Rank 0 writes the
accuracy and the records to OUT as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 eval_worker.py MODEL OUT \
        INDICES_JSON MAX_NEW_TOKENS
"""

import json
import sys
from pathlib import Path

from rollflash.broker.config.config import config_from_dict
from rollflash.envs import task_from_config
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.learner.build import build_models
from rollflash.learner.evaluation.eval_generate import heldout_accuracy
from rollflash.learner.process.dist import Dist, init_dist

BATCH = 2


def evaluate(model_dir: str, indices: list[int], max_new_tokens: int, dist: Dist) -> dict:
    """Held-out accuracy and records on `dist`'s ranks (one process: Dist())."""
    cfg = config_from_dict(
        {
            "model": {"path": model_dir},
            "rollout": {"max_new_tokens": max_new_tokens},
            "trainer": {"device": "cpu", "strategy": "fsdp"},
        }
    )
    models = build_models(cfg, dist)
    task = format_task(
        task_from_config(cfg), PromptFormatter(models.tokenizer, cfg.model.chat_template)
    )
    heldout = task.heldout_items()
    items = [heldout[i] for i in indices]
    rows: list[dict] = []
    acc = heldout_accuracy(
        models.policy,
        models.tokenizer,
        task,
        items,
        max_new_tokens,
        batch_size=BATCH,
        record=rows,
        dist=dist if dist.world_size > 1 else None,
    )
    return {"acc": acc, "rows": rows}


def main(model_dir: str, out: str, indices: str, max_new_tokens: int) -> None:
    dist = init_dist("cpu")
    result = evaluate(model_dir, json.loads(indices), max_new_tokens, dist)
    if dist.is_main:
        Path(out).write_text(json.dumps(result))
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
