"""Two gloo ranks under torchrun train to the same weights as one rank on the same batches,
with DDP (full and LoRA) and with FSDP2, PPO mini-batches and epochs included: the loss shares are
of the whole mini-batch, gradients are averaged over the ranks, a rank with less (or no) data this
update still takes part in every collective, and the tiny model's tied embedding stays tied on
every rank. The step's metrics are the one rank's too (learner/metrics/metric_sums.py): the ranks hold
unequal tokens, and a token mean, a loss and a maximum over both is what one rank computes
over all. Runs tests/integration/dist_worker.py as real processes, which builds the learner
through learner/build.py as `rollctl start-learner` does."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ranks import run_ranks
from tests.integration.dist_worker import STEPS

WORKER = Path(__file__).with_name("dist_worker.py")
PPO = {"ppo_mini_batches": 2, "ppo_epochs": 2}
LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}


def _train(model_dir, out, groups, nproc, stages):
    run_ranks(nproc, WORKER, str(model_dir), str(out), str(groups), json.dumps(stages))
    return [load_file(f"{out}.stage{i}") for i in range(len(stages))]


# a ratio of variances per micro-batch: its token-weighted mean depends on the split
SPLIT_DEPENDENT = {"critic/explained_var"}


def _metrics_match(one: Path, two: Path) -> None:
    """Every step's metrics of two ranks equal one rank's within 1e-6: the losses, clip
    fractions, entropy, KL, mismatch and off-policy metrics (means over the ranks' unequal
    tokens), the maxima and the counts. Relative above 1: the ranks' forward passes pad their
    micro-batches differently, so log-probs differ in float32's last digit (a ratio of e^1.85
    = 6.366 by 2e-6, 3 parts in 10^7)."""
    steps_one, steps_two = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(steps_one) == len(steps_two) == STEPS
    for a, b in zip(steps_one, steps_two):
        assert a.keys() == b.keys()
        for key in ("loss/policy", "policy/clip_frac", "policy/entropy", "mismatch/kl"):
            assert key in a
        for key in a.keys() - SPLIT_DEPENDENT:
            assert b[key] == pytest.approx(a[key], abs=1e-6, rel=1e-6), key


def _full_matches(one: dict, two: dict, start: dict) -> None:
    # a version holds the tied pair once, under the embedding's name
    assert "model.embed_tokens.weight" in one and "lm_head.weight" not in one
    assert one.keys() == two.keys()
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, atol=1e-5, rtol=0)
    assert any(not torch.equal(start[k], w) for k, w in one.items())  # the steps moved it


def _lora_matches(one: dict, two: dict) -> None:
    """LoRA adapters on q_proj and v_proj with a KL term against the base with the adapters
    off: the adapters two ranks train equal one rank's, and a version holds only them."""
    # 1 layer x (q_proj, v_proj) x (lora_A, lora_B): the adapter holds these 4 tensors only
    assert len(one) == 4 and all(".lora_A." in k or ".lora_B." in k for k in one)
    for name, w in one.items():
        torch.testing.assert_close(two[name], w, atol=1e-5, rtol=0)
    assert all(one[k].abs().max() > 0 for k in one if ".lora_B." in k)  # B started at zero


CASES = {
    # M = 2, E = 2 with a critic (GAE), the reference KL and packing; then LoRA, in one launch
    "ddp-uneven-3-2-gae-kl-packed-and-lora": (
        5,
        [
            {
                "strategy": "ddp",
                "trainer": {**PPO, "token_budget": 40},
                "algo": {"adv_estimator": "gae", "critic": True, "kl_coef": 0.1},
            },
            {"strategy": "ddp", "trainer": PPO, "lora": LORA, "algo": {"kl_coef": 0.1}},
        ],
    ),
    # FSDP reduce-scatters every micro-batch's gradient (the default), then once per update
    "fsdp-uneven-3-2-kl": (
        5,
        [
            {"strategy": "fsdp", "trainer": PPO, "algo": {"kl_coef": 0.1}},
            {
                "strategy": "fsdp",
                "trainer": {**PPO, "fsdp_reduce_scatter": "last_micro_batch"},
                "algo": {"kl_coef": 0.1},
            },
        ],
    ),
    "fsdp-one-rank-idle": (1, [{"strategy": "fsdp"}]),
}


@pytest.mark.parametrize("case", CASES)
def test_two_gloo_ranks_match_one_rank(tiny_model_dir, tmp_path, case):
    groups, stages = CASES[case]
    one = _train(tiny_model_dir, tmp_path / "one", groups, 1, stages)
    two = _train(tiny_model_dir, tmp_path / "two", groups, 2, stages)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for i, (stage, a, b) in enumerate(zip(stages, one, two)):
        _metrics_match(
            tmp_path / f"one.stage{i}.metrics.json", tmp_path / f"two.stage{i}.metrics.json"
        )
        if stage.get("lora"):
            _lora_matches(a, b)
        else:
            _full_matches(a, b, start)
        if stage["strategy"] == "fsdp":
            _reduce_scattered_as_configured(stage, tmp_path / f"two.stage{i}.grads.json")


def _reduce_scattered_as_configured(stage: dict, spy: Path) -> None:
    """Rank 0's micro-batches, in order: did every parameter hold a (sharded) gradient when the
    forward pass began? Each update starts without one (zero_grad); reduce-scattering every
    micro-batch fills them after its first pass, reduce-scattering once per update only after
    its last."""
    had, trainer = json.loads(spy.read_text()), stage.get("trainer", {})
    # e.g. 2 steps x M = 2 x E = 2 = 8 updates
    updates = STEPS * trainer.get("ppo_mini_batches", 1) * trainer.get("ppo_epochs", 1)
    if trainer.get("fsdp_reduce_scatter") == "last_micro_batch":
        assert not any(had) and len(had) > updates
    else:
        assert had.count(False) == updates and had.count(True) > 0
