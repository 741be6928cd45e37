"""Wire round trip and validation of the optional multi-turn sample fields (broker/wire/schema.py)."""

import msgpack
import numpy as np
import pytest

from rollflash.broker.wire.schema import (
    Sample,
    Trajectory,
    WireError,
    decode_trajectory,
    encode_trajectory,
)
from rollflash.broker.wire.wire import WireLimits

VOCAB = 50


def _fields(d: dict) -> dict[bytes, bytes]:
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in d.items()}


def _episode_sample(**over) -> Sample:
    # response = action "5 2" | observation "9 9" | action "6 2"
    s = Sample(
        response_ids=np.array([5, 2, 9, 9, 6, 2], np.int32),
        logprobs=np.array([-0.5, -0.1, 0, 0, -0.7, -0.2], np.float32),
        token_versions=np.zeros(6, np.int32),
        reward=1.0,
        finished=True,
        text="",
        loss_mask=np.array([1, 1, 0, 0, 1, 1], np.uint8),
        turn_starts=np.array([0, 4], np.int32),
        turn_rewards=np.array([0.0, 1.0], np.float32),
        turn_states=np.array([2**62 + 5, 17], np.int64),
    )
    for k, v in over.items():
        setattr(s, k, v)
    return s


def _round_trip(sample: Sample) -> Sample:
    t = Trajectory(
        traj_id="g",
        prompt_id="p",
        group_id="g",
        generator="x",
        behavior_version=0,
        issued_version=0,
        prompt_ids=np.array([1, 3], np.int32),
        samples=[sample],
    )
    return decode_trajectory(_fields(encode_trajectory(t)), WireLimits(1_000_000, VOCAB)).samples[0]


def test_multi_turn_fields_round_trip():
    s = _episode_sample()
    back = _round_trip(s)
    for name in ("loss_mask", "turn_starts", "turn_rewards", "turn_states"):
        np.testing.assert_array_equal(getattr(back, name), getattr(s, name))
    assert back.turn_states.dtype == np.int64 and back.turn_states[0] == 2**62 + 5


def test_single_turn_samples_carry_no_turn_keys():
    s = _episode_sample(loss_mask=None, turn_starts=None, turn_rewards=None, turn_states=None)
    t = Trajectory(
        traj_id="g",
        prompt_id="p",
        group_id="g",
        generator="x",
        behavior_version=0,
        issued_version=0,
        prompt_ids=np.array([1], np.int32),
        samples=[s],
    )
    body = msgpack.unpackb(encode_trajectory(t)["data"])
    assert set(body["samples"][0]) == {
        "response_ids",
        "logprobs",
        "token_versions",
        "reward",
        "finished",
        "text",
    }
    assert _round_trip(s).loss_mask is None


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"turn_states": None}, "incomplete, missing turn_states"),
        ({"loss_mask": np.array([1, 1, 0, 2, 1, 1], np.uint8)}, "loss_mask: must be 0/1"),
        ({"loss_mask": np.array([1, 1, 0], np.uint8)}, "loss_mask: must be 0/1"),
        ({"turn_starts": np.array([0, 2], np.int32)}, "turn_starts: not increasing model-token"),
        ({"turn_starts": np.array([4, 0], np.int32)}, "turn_starts: not increasing"),
        ({"turn_rewards": np.array([0.0], np.float32)}, "must be \\[K\\]"),
        ({"turn_rewards": np.array([0.0, np.nan], np.float32)}, "turn_rewards: not finite"),
        (  # no turn, but tokens of the model's
            {
                k: np.zeros(0, d)
                for k, d in [
                    ("turn_starts", np.int32),
                    ("turn_rewards", np.float32),
                    ("turn_states", np.int64),
                ]
            },
            "K >= 1",
        ),  # fmt: skip
    ],
)
def test_bad_multi_turn_fields_are_rejected(over, reason):
    with pytest.raises(WireError, match=reason):
        _round_trip(_episode_sample(**over))


def test_a_sample_with_no_model_token_has_no_turn():
    """An agent episode with nothing to train (generators/agent_episode.py): mask all 0, K = 0."""
    s = _episode_sample(
        loss_mask=np.zeros(6, np.uint8),
        turn_starts=np.zeros(0, np.int32),
        turn_rewards=np.zeros(0, np.float32),
        turn_states=np.zeros(0, np.int64),
    )
    back = _round_trip(s)
    assert back.loss_mask.sum() == 0 and back.turn_starts.shape == (0,)
