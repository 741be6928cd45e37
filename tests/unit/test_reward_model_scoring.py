"""Reward scoring (generators/rewarder.py) with a real scalar-head model built from the tiny
test model: batched scores equal one-at-a-time scores (padding and last-token pooling), the
generator's scorer agrees with the trainer's (the shared input contract, broker/wire/rm_input.py), and
`mixed` is weight_rule * rule + weight_model * model."""

import pytest
import torch

from rollflash.broker.config.config import config_from_dict
from rollflash.envs import Item, make_task
from rollflash.generators.rewarder import (
    ModelRewarder,
    RewardModelScorer,
    RuleRewarder,
    make_rewarder,
)
from rollflash.learner.tools.preferences import PreferencePair
from rollflash.learner.tools.rm_training import load_reward_model, pair_scores


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model as `rollctl train-rm` saves one (untrained head, seeded)."""
    torch.manual_seed(0)
    model, tokenizer = load_reward_model(tiny_model_dir)
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_batched_scores_equal_single_scores_and_the_trainers(rm_dir):
    scorer = RewardModelScorer(rm_dir, micro_batch_size=3, max_len=32)
    prompts = ["17+25=", "3+4=", "99+99=", "0+0=", "10+5="]
    responses = ["42", "7", "198", "0", "1599"]
    batched = scorer.score(prompts, responses)
    single = [scorer.score([p], [r])[0] for p, r in zip(prompts, responses)]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), atol=1e-5, rtol=0)
    assert len(set(round(s, 4) for s in batched)) == len(batched)  # the head is not constant
    model, tokenizer = load_reward_model(rm_dir)
    with torch.no_grad():
        chosen, _ = pair_scores(
            model.eval(),
            tokenizer,
            [PreferencePair(p, r, r + "x") for p, r in zip(prompts, responses)],
            32,
        )
    torch.testing.assert_close(chosen, torch.tensor(batched), atol=1e-5, rtol=0)


def test_mixed_reward_is_the_weighted_sum(rm_dir):
    task = make_task("arithmetic", {"ops": ["+"]})
    items = [Item("a", "17+25=", "42"), Item("b", "3+4=", "7")]
    responses = [["42", "43"], ["7", "x"]]
    scorer = RewardModelScorer(rm_dir, max_len=32)
    model_scores = [scorer.score([it.prompt] * 2, rs) for it, rs in zip(items, responses)]
    rule = RuleRewarder(task).score_groups(items, responses)
    assert rule == [[1.1, 0.1], [1.1, 0.0]]  # correct 1 + format 0.1; wrong but well formed 0.1
    mixed = ModelRewarder(task, scorer, weight_model=0.5, weight_rule=2.0).score_groups(
        items, responses
    )
    for g in range(2):
        for j in range(2):
            assert mixed[g][j] == pytest.approx(
                2.0 * rule[g][j] + 0.5 * model_scores[g][j], abs=1e-5
            )


def test_make_rewarder_follows_the_config(rm_dir):
    task = make_task("arithmetic", {"ops": ["+"]})
    assert isinstance(make_rewarder(config_from_dict({}), task), RuleRewarder)
    cfg = config_from_dict({"reward": {"type": "model", "model_path": str(rm_dir), "max_len": 32}})
    rewarder = make_rewarder(cfg, task)
    assert isinstance(rewarder, ModelRewarder) and rewarder.weight_rule == 0.0
    bad = config_from_dict({"reward": {"type": "model", "model_path": str(rm_dir / "nope")}})
    with pytest.raises(
        FileNotFoundError, match="reward.model_path: no Hugging Face model directory"
    ):
        make_rewarder(bad, task)
    grid = config_from_dict(
        {"task": {"name": "gridworld"}, "reward": {"type": "mixed", "model_path": str(rm_dir)}}
    )
    with pytest.raises(ValueError, match="reward.type: 'mixed' scores single responses"):
        make_rewarder(grid, make_task("gridworld", {}))
