"""Token-budget packing (learner/step/packing.py): the packed forward pass gives the padded one's
log-probabilities, entropies and values, and a packed training step computes the same loss and
gradients as a padded one, in every aggregation mode."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.learner.step.critic import Critic
from rollflash.learner.step.logprobs import token_logprobs
from rollflash.learner.step.packing import (
    PACKED_SDPA,
    _bounds,
    _use_packed_sdpa,
    budget_chunks,
    forward_packed,
    pack,
    unpack,
)
from rollflash.learner.step.prepare import build_algo_models
from rollflash.learner.step.train import train_step
from tests.integration.dist_worker import make_groups


def test_pack_lays_sequences_end_to_end_with_restarting_positions():
    ids = torch.tensor([[7, 8, 9], [5, 6, 0]])
    p = pack(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert p.input_ids.tolist() == [[7, 8, 9, 5, 6]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 3, 5]  # lengths 3 and 2
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


def test_packed_sdpa_bounds_from_cu_seqlens_or_position_jumps():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])  # sequences of 3, 2 and 1 tokens
    assert _bounds(None, None, pos, 6) == [0, 3, 5, 6]
    assert _bounds(None, torch.tensor([0, 3, 5, 6]), None, 6) == [0, 3, 5, 6]
    assert _bounds(None, None, torch.tensor([[4, 5, 6, 7]]), 4) is None  # one sequence
    assert _bounds(torch.ones(1, 1, 6, 6, dtype=torch.bool), None, pos, 6) is None  # a mask rules
    assert _bounds(None, None, torch.tensor([[0, 1, 2], [0, 1, 2]]), 3) is None  # plain rows
    with pytest.raises(ValueError, match="more than one row"):
        _bounds(None, None, torch.tensor([[0, 1, 2], [0, 1, 0]]), 3)


def test_sliding_window_models_keep_sdpa_and_its_dense_mask():
    from transformers import Qwen2Config

    plain = Qwen2Config(attn_implementation="sdpa")
    sliding = Qwen2Config(attn_implementation="sdpa", use_sliding_window=True, sliding_window=8)
    eager = Qwen2Config(attn_implementation="eager")
    assert (_use_packed_sdpa(plain), _use_packed_sdpa(sliding), _use_packed_sdpa(eager)) == (
        True,
        False,
        False,
    )


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
    expected = "eager" if attn == "eager" else PACKED_SDPA
    assert model.config._attn_implementation == expected
    # after the switch, padded calls are plain SDPA, and a packed row given position ids alone
    # (no sequence starts) is still cut into its sequences
    torch.testing.assert_close(token_logprobs(model, ids, mask, 0.7)[0], logp, atol=0, rtol=0)
    p = pack(ids, mask)
    torch.testing.assert_close(
        model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits,
        forward_packed(model, p).logits,
        atol=1e-6,
        rtol=0,
    )
    critic = Critic.load(model_dir, "float32", attn).eval()
    torch.nn.init.normal_(critic.value_head.weight)
    torch.testing.assert_close(
        critic(ids, mask, packed=True)[target], critic(ids, mask)[target], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "agg, checkpointing",
    [
        ("token-mean", False),
        ("seq-mean-token-mean", False),
        ("seq-mean-token-sum-norm", False),
        ("token-mean", True),
    ],
)
def test_packed_step_equals_padded_step(tiny, agg, checkpointing):
    """SGD with lr 1 makes the weight change equal to the gradient, so equal weights after the
    step mean equal gradients (Adam's first step would hide their scale). With activation
    checkpointing the recomputed packed forward must cut the row into the same sequences."""
    model_dir, tok = tiny
    groups = make_groups(tok, 5)
    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    if checkpointing:
        base.gradient_checkpointing_enable({"use_reentrant": False})
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
