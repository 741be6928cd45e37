"""pad_groups: the padded group-major batch, by hand and against a per-sample reference loop."""

import numpy as np
import torch

from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.step.batch import pad_groups


def _sample(ids, logp, loss_mask=None) -> Sample:
    n = len(ids)
    return Sample(
        np.array(ids, np.int32),
        np.array(logp, np.float32),
        np.zeros(n, np.int32),
        1.0,
        True,
        loss_mask=None if loss_mask is None else np.array(loss_mask, np.uint8),
    )


def _group(prompt, samples) -> Trajectory:
    return Trajectory("g", "p", "g", "gen", 0, 0, np.array(prompt, np.int32), samples)


def test_one_group_by_hand():
    # prompt [1, 2]; responses [3] and [4, 5] -> width 4; target column t scores token t + 1,
    # so the responses' targets are column 1 (row 0) and columns 1..2 (row 1)
    g = _group([1, 2], [_sample([3], [-0.5]), _sample([4, 5], [-0.25, -0.75])])
    b = pad_groups([g], keep=torch.tensor([True, False]))
    assert b.input_ids.tolist() == [[1, 2, 3, 0], [1, 2, 4, 5]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert b.mask.tolist() == [[False, True, False], [False, False, False]]  # row 1 not kept
    assert b.behav_logp.tolist() == [[0.0, -0.5, 0.0], [0.0, -0.25, -0.75]]
    assert b.input_ids.dtype == torch.long and b.mask.dtype == torch.bool
    assert pad_groups([]).input_ids.shape == (0, 1)


def _reference(groups, keep):
    """The per-sample loop pad_groups replaces."""
    seqs = [(g.prompt_ids.tolist(), s) for g in groups for s in g.samples]
    width = max(len(p) + len(s.response_ids) for p, s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    behav = torch.zeros(len(seqs), width - 1)
    for i, (p, s) in enumerate(seqs):
        n = len(p) + len(s.response_ids)
        ids[i, :n] = torch.tensor(p + s.response_ids.tolist())
        resp = slice(len(p) - 1, n - 1)
        mask[i, resp] = bool(keep[i])
        if s.loss_mask is not None:
            mask[i, resp] &= torch.from_numpy(s.loss_mask.astype(bool))
        behav[i, resp] = torch.from_numpy(s.logprobs)
    return ids, mask, behav


def test_matches_a_per_sample_loop_on_random_multi_turn_groups():
    rng = np.random.default_rng(0)
    groups = []
    for _ in range(5):
        prompt = rng.integers(1, 50, rng.integers(1, 6)).tolist()
        samples = []
        for _ in range(3):
            t = int(rng.integers(1, 9))
            samples.append(
                _sample(rng.integers(1, 50, t), -rng.random(t), (rng.random(t) < 0.6).tolist())
            )
        groups.append(_group(prompt, samples))
    keep = torch.from_numpy(rng.random(15) < 0.7)
    b = pad_groups(groups, keep=keep)
    ids, mask, behav = _reference(groups, keep)
    assert torch.equal(b.input_ids, ids) and torch.equal(b.mask, mask)
    torch.testing.assert_close(b.behav_logp, behav, rtol=0, atol=0)
    assert torch.equal(b.attention_mask, (ids != 0).long())  # no token id 0 in these groups
