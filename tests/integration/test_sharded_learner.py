"""Two gloo ranks against one process, in one torchrun launch (tests/integration/sharded_worker.py):
batch statistics are global (2 ranks == 1 rank for reward_norm batch, running and
whiten_advantages), FSDP2 with MixedPrecisionPolicy keeps fp32 sharded masters, and
torch.distributed.checkpoint checkpoints move between 1 and 2 ranks both ways within 1e-5."""

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.durability.checkpoint_io import Trainables, load_dcp, save_dcp
from rollflash.learner.process.dist import Dist
from rollflash.learner.step.prepare import AlgoModels
from rollflash.learner.step.train import train_step
from tests.helpers.ranks import run_ranks
from tests.integration.dist_worker import make_groups

WORKER = Path(__file__).with_name("sharded_worker.py")


def _built(model_dir):
    """(config, policy, optimiser) of one rank, from learner/build.py's builders."""
    cfg = config_from_dict(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 3, "device": "cpu", "actor_lr": 1e-3},
        }
    )
    models = build_models(cfg, Dist())
    return cfg, models.model, build_optim(cfg, models).optimizer


def _one_rank_run(model_dir, tmp_path):
    """One process: a step on groups 0-1, checkpointed with DCP, then a step on groups 2-3."""
    cfg, model, optimizer = _built(model_dir)
    groups = make_groups(AutoTokenizer.from_pretrained(model_dir), 4)
    train_step(model, optimizer, groups[:2], cfg, AlgoModels())
    save_dcp(Trainables(model, optimizer), tmp_path / "one")
    train_step(model, optimizer, groups[2:], cfg, AlgoModels())
    return model


def test_two_ranks_share_statistics_shards_and_checkpoints_with_one(tiny_model_dir, tmp_path):
    one = _one_rank_run(tiny_model_dir, tmp_path)
    run_ranks(2, WORKER, str(tiny_model_dir), str(tmp_path), str(tmp_path / "one"))
    # saved on 1 rank, resumed on 2 (FSDP): the next step gives the one-rank weights
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    for name, w in one.state_dict().items():
        if name in resumed:
            torch.testing.assert_close(resumed[name], w, atol=1e-5, rtol=0)
    # saved on 2 ranks (FSDP, bf16 compute), resumed on 1: the same weights and optimiser state
    gathered = load_file(str(tmp_path / "mp.safetensors"))
    _, model, optimizer = _built(tiny_model_dir)
    load_dcp(Trainables(model, optimizer), tmp_path / "ckpt")
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, w in gathered.items():
        torch.testing.assert_close(model.state_dict()[name], w, atol=1e-5, rtol=0)
    assert any(not torch.equal(gathered[k], start[k]) for k in gathered if k in start)
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert len(moments) == len(list(model.parameters())) and any(m.abs().sum() > 0 for m in moments)
