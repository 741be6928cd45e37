"""Score shaping and the DAPO group filters (learner/step/filters.py), with hand-worked numbers, and the
padding/splitting of learner/step/batch.py."""

from __future__ import annotations

import numpy as np
import torch

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.step.batch import length_sorted_chunks, pad_groups, take
from rollflash.learner.step.filters import ScoreSpec, filter_groups, group_scores


def _group(name, samples, prompt=(1, 7, 8)):
    """samples: (response length, reward, finished); response tokens are 10, 11, ..."""
    built = [
        Sample(
            np.arange(10, 10 + n, dtype="<i4"),
            np.full(n, -0.5, "<f4"),
            np.zeros(n, "<i4"),
            reward=r,
            finished=f,
        )
        for n, r, f in samples
    ]
    return Trajectory(name, name, name, "gen-0", 0, 0, np.array(prompt, "<i4"), built)


def _spec(**algo) -> ScoreSpec:
    return ScoreSpec.of(
        config_from_dict(
            {"rollout": {"num_return_sequences": 2, "max_new_tokens": 8}, "algo": algo}
        )
    )


def test_soft_overlong_penalty_then_clip():
    # max_new_tokens 8, buffer 4 -> no penalty up to 8 - 4 = 4 tokens, then -(L - 4) / 4 * factor:
    # L=4: 0; L=6: -(2/4) * 0.5 = -0.25; L=8: -(4/4) * 0.5 = -0.5. Then clip to [-0.6, 0.6]:
    # 1 + 0 -> 0.6; 1 - 0.25 = 0.75 -> 0.6; 0 - 0.5 = -0.5 stays.
    spec = _spec(overlong_buffer=4, overlong_penalty_factor=0.5, reward_clip=0.6)
    g = _group("a", [(4, 1.0, True), (6, 1.0, True), (8, 0.0, False)])
    torch.testing.assert_close(group_scores(g, spec), torch.tensor([0.6, 0.6, -0.5]))
    unshaped = group_scores(g, _spec())
    torch.testing.assert_close(unshaped, torch.tensor([1.0, 1.0, 0.0]))


def test_dynamic_sampling_drops_groups_with_equal_scores():
    equal = _group("equal", [(2, 1.0, True), (3, 1.0, True)])
    mixed = _group("mixed", [(2, 1.0, True), (3, 0.0, True)])
    kept, dropped = filter_groups([equal, mixed], _spec(dynamic_sampling=True))
    assert [g.traj_id for g in kept] == ["mixed"] and [g.traj_id for g in dropped] == ["equal"]
    # without the option nothing is dropped
    assert filter_groups([equal, mixed], _spec()) == ([equal, mixed], [])


def test_overlong_penalty_can_give_an_equal_reward_group_a_spread():
    # rewards [1, 1], lengths 4 and 6 with buffer 4: scores 1 and 0.75 -> kept
    g = _group("g", [(4, 1.0, True), (6, 1.0, True)])
    kept, _ = filter_groups([g], _spec(dynamic_sampling=True, overlong_buffer=4))
    assert kept == [g]


def test_overlong_filter_drops_only_groups_with_nothing_left():
    all_cut = _group("cut", [(8, 0.0, False), (8, 1.0, False)])
    one_cut = _group("one", [(8, 0.0, False), (3, 1.0, True)])
    kept, dropped = filter_groups([all_cut, one_cut], _spec(overlong_filter=True))
    assert kept == [one_cut] and dropped == [all_cut]


def test_pad_groups_masks_response_targets_and_kept_rows_only():
    # prompt (1, 7, 8) + 2 response tokens (10, 11): targets at positions 2 and 3 of [b, L-1]
    g = _group("g", [(2, 1.0, True), (1, 0.0, False)])
    batch = pad_groups([g], keep=torch.tensor([True, False]))
    assert batch.input_ids.tolist() == [[1, 7, 8, 10, 11], [1, 7, 8, 10, 0]]
    assert batch.mask.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert batch.behav_logp[0].tolist() == [0.0, 0.0, -0.5, -0.5]
    assert batch.behav_logp[1].tolist() == [0.0, 0.0, -0.5, 0.0]  # kept even where masked
    assert batch.num_seqs == 1 and batch.num_tokens == 2


def test_micro_batches_are_length_sorted_and_trimmed():
    g = _group("g", [(5, 1.0, True), (1, 0.0, True), (3, 0.0, True)])
    batch = pad_groups([g])
    chunks = length_sorted_chunks(batch, 2)
    assert [c.tolist() for c in chunks] == [[1, 2], [0]]  # lengths 4, 6 | 8
    first = take(batch, chunks[0])
    assert first.input_ids.shape == (2, 6) and first.mask.shape == (2, 5)
    assert first.input_ids[0].tolist() == [1, 7, 8, 10, 0, 0]
