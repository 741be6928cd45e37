"""One learner rank for tests/integration/test_distributed_learner.py, run under torchrun (or
alone as the one-rank reference). The model, its optimiser and the algorithm's models are built by
the builders `rollctl start-learner` uses (learner/build.py `build_models`, `build_optim`); then
STEPS `train_step`s on this rank's share of fixed groups. Rank r trains a contiguous slice of the
groups, so the ranks' groups in rank order are the one rank's batch. After the steps every rank
checks that a tied model is still tied, and rank 0 saves what a weight version would hold
(learner/models/lora.py `published_weights`: the whole model with a tied tensor once, or a LoRA
adapter).

    python -m torch.distributed.run --standalone --nproc-per-node 2 dist_worker.py MODEL OUT GROUPS \
        STAGES_JSON

STAGES_JSON: a list of {"strategy": ddp|fsdp, "trainer": {...}, "algo": {...}, "lora": {...}|null};
stage i saves to OUT + ".stage{i}" (several stages share one launch) and each step's metrics, as
`train_step` returns them (over every rank), to OUT + ".stage{i}.metrics.json"; every rank
checks that it returned the same ones as rank 0. With several ranks, rank 0
also writes OUT + ".stage{i}.grads.json": for every micro-batch's policy loss, in order, whether
all of the policy's parameters held a gradient when its forward pass began (a spy around
learner/step/train.py's `policy_loss`), which tells when FSDP reduce-scattered.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.models.lora import peft_model, published_weights
from rollflash.learner.process.dist import init_dist, split_quotas
from rollflash.learner.step import train as train_module
from rollflash.learner.step.train import train_step

STEPS = 2


def make_groups(tok, count: int, n: int = 4) -> list[Trajectory]:
    """`count` groups of mixed response lengths and rewards, the same on every rank."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(count):
        prompt = tok(f"{g + 11}+{g + 3}=")["input_ids"]
        samples = []
        for _ in range(n):
            text = str(int(rng.integers(1, 10 ** int(rng.integers(1, 5)))))
            resp = tok(text)["input_ids"][1:] + [tok.eos_token_id]
            samples.append(
                Sample(
                    np.array(resp, "<i4"),
                    rng.uniform(-3, -0.5, len(resp)).astype("<f4"),
                    np.zeros(len(resp), "<i4"),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        groups.append(
            Trajectory(f"t{g}", f"p{g}", f"g{g}", "gen", 0, 0, np.array(prompt, "<i4"), samples)
        )
    return groups


def my_share(groups: list, rank: int, world: int) -> list:
    """This rank's contiguous slice: [3, 2] of 5 groups on 2 ranks."""
    quotas = split_quotas([len(groups)] * world, len(groups))
    start = sum(quotas[:rank])
    return groups[start : start + quotas[rank]]


def tied(model: torch.nn.Module) -> bool:
    inner = getattr(model, "module", model)
    base = peft_model(inner).get_base_model() if peft_model(inner) is not None else inner
    return base.get_output_embeddings().weight is base.get_input_embeddings().weight


def train(dist, model_dir: str, out: str, count: int, stage: dict) -> None:
    torch.manual_seed(0)  # every run (and rank) starts from the same adapters and heads
    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "lora": stage.get("lora")},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {
                "micro_batch_size": 3,
                "rollout_batch_size": count,
                "strategy": stage["strategy"],
                "device": "cpu",
                "actor_lr": 1e-3,
                **stage.get("trainer", {}),
            },
            "algo": stage.get("algo", {}),
        }
    )
    models = build_models(cfg, dist)
    optim = build_optim(cfg, models)
    mine = my_share(make_groups(models.tokenizer, count), dist.rank, dist.world_size)
    had_grads: list[bool] = []
    policy_loss = train_module.policy_loss

    def spy(model, mb, cfg):
        had_grads.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))
        return policy_loss(model, mb, cfg)

    train_module.policy_loss = spy
    steps = []
    try:
        for _ in range(STEPS):
            stats = train_step(models.model, optim.optimizer, mine, cfg, models.algo, dist)
            assert stats["optim/skipped"] == 0.0
            assert stats["optim/updates"] == cfg.trainer.updates_per_step
            assert dist.gather(stats)[0] == stats, f"rank {dist.rank}: not rank 0's metrics"
            steps.append(stats)
            optim.scheduler.step()
    finally:
        train_module.policy_loss = policy_loss
    if dist.is_main:
        Path(f"{out}.metrics.json").write_text(json.dumps(steps))
    if dist.is_main and dist.world_size > 1:
        Path(f"{out}.grads.json").write_text(json.dumps(had_grads))
    assert tied(models.model), f"rank {dist.rank}: lm_head is no longer embed_tokens"
    weights, _ = published_weights(models.model, cfg)
    if dist.is_main:
        save_file(weights, out)


def main(model_dir: str, out: str, count: int, stages: str) -> None:
    torch.use_deterministic_algorithms(True)
    dist = init_dist("cpu")
    for i, stage in enumerate(json.loads(stages)):
        train(dist, model_dir, f"{out}.stage{i}", count, stage)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
