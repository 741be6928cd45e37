"""Token-budget packing (learner/packing.py): the packed forward pass gives the padded one's
log-probabilities, entropies and values, and a packed training step computes the same loss and
gradients as a padded one, in every aggregation mode."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config import config_from_dict
from rollflash.learner.critic import Critic
from rollflash.learner.logprobs import token_logprobs
from rollflash.learner.packing import budget_chunks, pack, unpack
from rollflash.learner.prepare import build_algo_models
from rollflash.learner.train import train_step
from tests.integration.dist_worker import make_groups


def test_pack_lays_sequences_end_to_end_with_restarting_positions():
    ids = torch.tensor([[7, 8, 9], [5, 6, 0]])
    p = pack(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert p.input_ids.tolist() == [[7, 8, 9, 5, 6]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert not hasattr(p, "attention_mask")  # the restarting positions mark the boundaries
    # next-token positions: packed 0,1 -> row 0 cols 0,1; packed 3 -> row 1 col 0 (packed 2
    # would predict across the boundary and is dropped)
    assert list(zip(p.rows.tolist(), p.cols.tolist(), p.src.tolist())) == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 3),
    ]
    x = torch.tensor([[10.0, 11.0, 99.0, 13.0]])
    assert unpack(x, p, (2, 2)).tolist() == [[10.0, 11.0], [13.0, 0.0]]


def test_budget_chunks_first_fit_decreasing():
    # lengths 5, 3, 4, 2 with budget 7: 5 opens bin A (room 2), 4 opens B (room 3),
    # 3 fills B, 2 fills A
    chunks = budget_chunks(torch.tensor([5, 3, 4, 2]), 7)
    assert [c.tolist() for c in chunks] == [[0, 3], [2, 1]]
    assert [c.tolist() for c in budget_chunks(torch.tensor([9, 2]), 4)] == [[0], [1]]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir)


def _padded(tok, texts):
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_forward_equals_padded(tiny, attn):
    """Position ids alone (no mask, no cache) keep each packed sequence to its own tokens, for
    eager attention too (a dense boolean mask added to eager's scores was 0.25 off)."""
    model_dir, tok = tiny
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()
    ids, mask = _padded(tok, ["12+7=19", "3+4=7", "100+250=350", "1+1=2"])
    target = mask[:, 1:].bool()
    logp, ent = token_logprobs(model, ids, mask, 0.7, with_entropy=True)
    plogp, pent = token_logprobs(model, ids, mask, 0.7, with_entropy=True, packed=True)
    torch.testing.assert_close(plogp[target], logp[target], atol=1e-5, rtol=0)
    torch.testing.assert_close(pent[target], ent[target], atol=1e-5, rtol=0)
    assert torch.all(plogp[~target] == 0)
    critic = Critic.load(model_dir, "float32", attn).eval()
    torch.nn.init.normal_(critic.value_head.weight)
    torch.testing.assert_close(
        critic(ids, mask, packed=True)[target], critic(ids, mask)[target], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_step_equals_padded_step(tiny, agg):
    """SGD with lr 1 makes the weight change equal to the gradient, so equal weights after the
    step mean equal gradients (Adam's first step would hide their scale)."""
    model_dir, tok = tiny
    groups = make_groups(tok, 5)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    results = []
    for trainer in ({"micro_batch_size": 3}, {"token_budget": 40}):
        cfg = config_from_dict(
            {
                "model": {"path": str(model_dir)},
                "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
                "trainer": trainer,
                "algo": {"loss_agg_mode": agg},
            }
        )
        model = copy.deepcopy(base)
        stats = train_step(
            model, torch.optim.SGD(model.parameters(), lr=1.0), groups, cfg, build_algo_models(cfg)
        )
        results.append((stats, model.state_dict()))
    (padded, w_pad), (packed, w_pack) = results
    torch.testing.assert_close(packed["loss/policy"], padded["loss/policy"], atol=1e-6, rtol=0)
    for name, w in w_pad.items():
        torch.testing.assert_close(w_pack[name], w, atol=1e-5, rtol=0)
    assert any(not torch.equal(w, base.state_dict()[k]) for k, w in w_pad.items())
