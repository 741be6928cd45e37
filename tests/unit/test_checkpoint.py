"""Learner checkpoints (learner/durability/checkpoint.py): a resumed model, optimiser and scheduler continue
bit for bit where the uninterrupted run goes; the version -> step lineage after a resume; only
complete checkpoints are used; retention."""

import copy
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.durability.checkpoint import (
    CheckpointStore,
    LearnerState,
    restore_rng,
    rng_state,
)
from rollflash.learner.durability.checkpoint_io import Trainables
from rollflash.learner.intake.lineage import Lineage
from rollflash.learner.step.prepare import build_algo_models
from rollflash.learner.step.train import train_step
from tests.integration.dist_worker import make_groups


def test_lineage_maps_versions_to_steps_across_resumes():
    lin = Lineage()
    assert [lin.step_of(v) for v in (0, 5, 9)] == [0, 5, 9]  # no resume: version == step
    # crash after publishing v9, resume from the checkpoint of step 6: v10 holds step 6
    lin.rebase(next_version=10, next_step=6)
    assert lin.step_of(9) == 9 and lin.step_of(10) == 6 and lin.step_of(12) == 8
    # a second crash: published up to v14 (step 10), resumed from step 9 as v15
    lin.rebase(next_version=15, next_step=9)
    assert [lin.step_of(v) for v in (13, 14, 15, 16)] == [9, 10, 9, 10]
    state = LearnerState(lineage=lin, guards={"kl_coef": 0.05, "streaks": {"kl_rise": 1}})
    back = LearnerState.from_json(json.loads(json.dumps(state.to_json())))
    assert back.lineage == lin and back.guards == state.guards


def test_state_json_round_trips_and_a_missing_key_is_an_error():
    state = LearnerState(
        step=7,
        version=9,
        issued=40,
        replaced=3,
        seen={5: ["g000000001"], 7: ["g000000002"]},
        ranks={"rank0": {"entry_ids": ["1-0"], "traj_ids": ["g000000002"], "ledger_offset": 12}},
    )
    back = LearnerState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state  # JSON keys are strings: `seen` is filed by int issue step again
    incomplete = {k: v for k, v in state.to_json().items() if k != "guards"}
    with pytest.raises(KeyError, match="guards"):
        LearnerState.from_json(incomplete)


def test_rng_state_round_trips():
    state = rng_state()
    a = (random.random(), torch.rand(2).tolist())
    restore_rng(json.loads(json.dumps({"rank0": state})), rank=0)
    assert (random.random(), torch.rand(2).tolist()) == a


def test_each_rank_restores_its_own_rng_state():
    torch.manual_seed(1)
    rank0 = rng_state()
    torch.manual_seed(2)
    rank1 = rng_state()
    b = torch.rand(2).tolist()  # what rank 1 draws next
    saved = json.loads(json.dumps({"rank0": rank0, "rank1": rank1}))
    torch.manual_seed(3)
    restore_rng(saved, rank=1)
    assert torch.rand(2).tolist() == b
    torch.manual_seed(4)
    kept = torch.get_rng_state()
    restore_rng(saved, rank=2)  # a rank the checkpoint has no state for keeps its seed
    assert torch.equal(torch.get_rng_state(), kept)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir)


def _setup(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def test_resumed_training_continues_exactly(tiny, tmp_path):
    model_dir, tok = tiny
    cfg = config_from_dict(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
        }
    )
    groups = make_groups(tok, 4)

    def step(model, opt, sched, part):
        train_step(model, opt, part, cfg, build_algo_models(cfg))
        sched.step()

    model, opt, sched = _setup(model_dir)
    step(model, opt, sched, groups[:2])
    store = CheckpointStore(tmp_path)
    store.save(
        LearnerState(
            step=1, version=1, issued=8, seen={0: ["t0", "t1"]}, scheduler=sched.state_dict()
        ),
        Trainables(model, opt),
    )
    assert (store.latest() / "dcp" / ".metadata").is_file()
    step(model, opt, sched, groups[2:])
    uninterrupted = copy.deepcopy(model.state_dict())

    model2, opt2, sched2 = _setup(model_dir)  # a fresh process
    state = CheckpointStore.load(store.latest(), Trainables(model2, opt2))
    sched2.load_state_dict(state.scheduler)
    assert (state.step, state.issued, state.seen) == (1, 8, {0: ["t0", "t1"]})
    step(model2, opt2, sched2, groups[2:])
    for name, w in uninterrupted.items():
        assert torch.equal(model2.state_dict()[name], w), name
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_only_complete_checkpoints_are_used_and_two_are_kept(tmp_path):
    store = CheckpointStore(tmp_path)
    model = torch.nn.Linear(2, 2)
    assert store.latest() is None
    for s in (1, 2, 3):
        store.save(LearnerState(step=s), Trainables(model))
    assert store.latest().name == "step00000003"
    assert sorted(d.name for d in store.root.glob("step*")) == ["step00000002", "step00000003"]
    # a crash mid-save leaves a temp dir: never used, removed at the next start
    (store.root / ".tmp-step00000004").mkdir()
    assert store.latest().name == "step00000003" and store.clean_temp() == 1
    # a directory without state.json (written last) is not a checkpoint, even if LATEST names it
    (store.root / "step00000004").mkdir()
    (store.root / "LATEST").write_text("4\n")
    assert store.latest().name == "step00000003"


def test_a_single_process_checkpoint_warns_of_nothing(tmp_path):
    # DCP warns "torch.distributed is disabled, unavailable or uninitialized ..." on every save
    # and load of a single process; the learner's checkpoints say nothing of the kind
    import warnings

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = CheckpointStore(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.save(LearnerState(step=1, version=1), Trainables(model, opt))
        CheckpointStore.load(store.latest(), Trainables(torch.nn.Linear(3, 2)))
    assert [str(w.message) for w in caught] == []
