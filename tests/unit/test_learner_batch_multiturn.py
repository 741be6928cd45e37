"""learner/step/batch.py on multi-turn episodes: observation tokens masked out, turns laid out."""

import numpy as np
import pytest
import torch

from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.step.batch import pad_groups, turn_inputs


def _episode(resp, loss_mask, starts, rewards, states) -> Sample:
    n = len(resp)
    return Sample(
        np.array(resp, "<i4"),
        np.where(np.array(loss_mask) > 0, -0.5, 0).astype("<f4"),
        np.zeros(n, "<i4"),
        float(sum(rewards)),
        True,
        "",
        loss_mask=np.array(loss_mask, "|u1"),
        turn_starts=np.array(starts, "<i4"),
        turn_rewards=np.array(rewards, "<f4"),
        turn_states=np.array(states, "<i8"),
    )


def _group() -> Trajectory:
    a = _episode([10, 2, 20, 21, 11, 2], [1, 1, 0, 0, 1, 1], [0, 4], [0.0, 1.0], [5, 6])
    b = _episode([12, 2], [1, 1], [0], [0.0], [5])
    return Trajectory("g", "p", "g", "gen", 0, 0, np.array([1, 3, 4], "<i4"), [a, b])


def test_observation_targets_are_masked():
    batch = pad_groups([_group()])
    # prompt of 3 tokens: response position p is predicted at column 2 + p
    assert batch.mask[0].tolist() == [False, False, True, True, False, False, True, True]
    assert batch.mask[1].tolist() == [False, False, True, True, False, False, False, False]
    assert batch.behav_logp[0, 4] == 0 and batch.behav_logp[0, 6] == -0.5


def test_observation_targets_stay_masked_when_the_filter_keeps_the_sample():
    batch = pad_groups([_group()], keep=torch.tensor([True, False]))
    assert batch.mask[0, 4:6].tolist() == [False, False] and not batch.mask[1].any()


def test_turn_inputs_layout():
    group = _group()
    batch = pad_groups([group])
    t = turn_inputs([group], batch.mask)
    assert t.token_turn[0].tolist() == [-1, -1, 0, 0, -1, -1, 1, 1]
    assert t.token_turn[1].tolist() == [-1, -1, 0, 0, -1, -1, -1, -1]
    assert t.mask.tolist() == [[True, True], [True, False]]
    assert t.rewards.tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert t.state_ids.tolist() == [[5, 6], [5, 0]]


def test_single_turn_batches_have_no_turns_and_mixing_is_an_error():
    group = _group()
    plain = Sample(np.array([7, 2], "<i4"), np.full(2, -0.1, "<f4"), np.zeros(2, "<i4"), 1.0, True)
    single = Trajectory("h", "p", "h", "gen", 0, 0, np.array([1], "<i4"), [plain, plain])
    assert turn_inputs([single], pad_groups([single]).mask) is None
    with pytest.raises(ValueError, match="mixes multi-turn"):
        turn_inputs([group, single], pad_groups([group, single]).mask)


def test_a_sample_without_turns_trains_nothing_and_keeps_its_row():
    """An agent episode with no model token (generators/agent_episode.py): loss mask 0, K = 0."""
    a = _episode([10, 2, 20, 21, 11, 2], [1, 1, 0, 0, 1, 1], [0, 4], [0.0, 1.0], [5, 6])
    empty = _episode([2], [0], [], [], [])
    group = Trajectory("g", "p", "g", "gen", 0, 0, np.array([1, 3, 4], "<i4"), [a, empty])
    batch = pad_groups([group])
    assert not batch.mask[1].any()
    t = turn_inputs([group], batch.mask)
    assert t.mask.tolist() == [[True, True], [False, False]]
    assert t.token_turn[1].tolist() == [-1] * 8
    # the GiGPO estimator runs over it (its episode score enters the group baseline)
    from rollflash.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageInputs

    scores = torch.tensor([1.0, 0.0])
    inputs = AdvantageInputs(scores, batch.mask, 2, turns=t)
    out = ADVANTAGE_ESTIMATORS["gigpo"](inputs, AdvantageConfig())
    assert torch.isfinite(out.advantages).all() and not out.advantages[1].any()
