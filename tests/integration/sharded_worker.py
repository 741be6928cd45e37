"""Two gloo ranks for tests/integration/test_sharded_learner.py, under torchrun:

1. global statistics: each rank's advantages with reward_norm batch / running and
   whiten_advantages, and the reward std of the guards, equal one rank's over all groups
   (computed here, in-process, with Dist());
2. a DCP checkpoint written by one process (CKPT_IN) loads into FSDP2 shards, and one step on
   the two ranks' shares gives the weights one rank gets (rank 0 writes them to OUT/resumed);
3. FSDP2 with MixedPrecisionPolicy (model.dtype bfloat16): fp32 sharded masters, bf16 compute, one
   step; the sharded model and optimiser are saved with DCP to OUT/ckpt, and rank 0 writes the
   gathered weights to OUT/mp.safetensors for the one-rank load to compare against.

Models and optimisers are built by learner/build.py's builders, as `rollctl start-learner` builds
them (a tied model, sharded on the meta device and broadcast from rank 0).

    python -m torch.distributed.run --standalone --nproc-per-node 2 sharded_worker.py MODEL OUT CKPT_IN
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.durability.checkpoint_io import Trainables, load_dcp, save_dcp
from rollflash.learner.metrics.guards import score_std
from rollflash.learner.process.dist import Dist, full_state_dict, init_dist
from rollflash.learner.step.global_stats import global_std
from rollflash.learner.step.prepare import AlgoModels, prepare_batch
from rollflash.learner.step.step_spec import StepSpec
from rollflash.learner.step.train import train_step
from tests.integration.dist_worker import make_groups


def _cfg(model_dir: str, dtype: str = "float32", **algo):
    """The config of every check; its sharded models are built by the builders `rollctl
    start-learner` uses (learner/build.py)."""
    return config_from_dict(
        {
            "model": {"path": model_dir, "dtype": dtype},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {
                "micro_batch_size": 3,
                "strategy": "fsdp",
                "device": "cpu",
                "actor_lr": 1e-3,
            },
            "algo": algo,
        }
    )


def _advantages_of(groups, cfg, models, dist):
    return prepare_batch(groups, StepSpec.of(cfg), models, dist).step.advantages


def check_global_stats(model_dir: str, tok, dist: Dist) -> None:
    n = 4
    for algo in ({"reward_norm": "batch"}, {"reward_norm": "running", "whiten_advantages": True}):
        cfg = _cfg(model_dir, adv_estimator="rloo", **algo)
        mine_models, one_models = AlgoModels(), AlgoModels()
        for step in range(2):  # two steps: the running statistics carry over
            groups = make_groups(tok, 5)[step:]  # 5 then 4 groups: uneven shares
            mine = _advantages_of(groups[dist.rank :: 2], cfg, mine_models, dist)
            one = _advantages_of(groups, cfg, one_models, Dist())
            for i, g in enumerate(range(dist.rank, len(groups), 2)):
                rows = one[g * n : (g + 1) * n, : mine.shape[1]]
                torch.testing.assert_close(mine[i * n : (i + 1) * n], rows, atol=1e-6, rtol=0)
        assert mine_models.reward_norm == one_models.reward_norm or algo["reward_norm"] == "batch"
    rewards = [s.reward for g in make_groups(tok, 5) for s in g.samples]
    mine = [s.reward for g in make_groups(tok, 5)[dist.rank :: 2] for s in g.samples]
    assert abs(global_std(mine, dist) - score_std(rewards)) < 1e-9  # guard/score_std


def check_resume_from_one_rank(model_dir: str, tok, dist: Dist, ckpt_in: Path, out: Path) -> None:
    cfg = _cfg(model_dir)
    models = build_models(cfg, dist)
    model, optimizer = models.model, build_optim(cfg, models).optimizer
    load_dcp(Trainables(model, optimizer), ckpt_in)
    groups = make_groups(tok, 4)[2:]
    train_step(model, optimizer, groups[dist.rank :: 2], cfg, AlgoModels(), dist)
    weights = full_state_dict(model)
    if dist.is_main:
        save_file(weights, str(out / "resumed.safetensors"))


def check_mixed_precision(model_dir: str, tok, dist: Dist, out: Path) -> None:
    cfg = _cfg(model_dir, dtype="bfloat16")
    models = build_models(cfg, dist)
    model, optimizer = models.model, build_optim(cfg, models).optimizer
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.bfloat16  # bf16 compute
    stats = train_step(
        model, optimizer, make_groups(tok, 2)[dist.rank :: 2], cfg, AlgoModels(), dist
    )
    assert torch.isfinite(torch.tensor(stats["loss/policy"]))
    for p in model.parameters():  # fp32 sharded masters and fp32 reduced gradients
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert p.to_local().numel() < p.numel() or p.numel() == 1
    save_dcp(Trainables(model, optimizer), out / "ckpt")
    weights = full_state_dict(model)
    if dist.is_main:
        save_file(weights, str(out / "mp.safetensors"))


def main(model_dir: str, out: str, ckpt_in: str) -> None:
    torch.manual_seed(0)
    dist = init_dist("cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    check_global_stats(model_dir, tok, dist)
    check_resume_from_one_rank(model_dir, tok, dist, Path(ckpt_in), Path(out))
    check_mixed_precision(model_dir, tok, dist, Path(out))
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
