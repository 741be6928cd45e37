import msgpack
import numpy as np
import pytest

from rollflash.broker.wire.schema import (
    PromptWork,
    Sample,
    Trajectory,
    WireError,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
)
from rollflash.broker.wire.wire import WireLimits

VOCAB = 50
LIMITS = WireLimits(max_bytes=1_000_000, vocab_size=VOCAB)


def _fields(d: dict) -> dict[bytes, bytes]:
    """What redis-py returns for an entry XADDed with `d`: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in d.items()}


def _traj(**over) -> Trajectory:
    s = Sample(
        response_ids=np.array([5, 6, 2], np.int32),
        logprobs=np.array([-0.5, -1.25, -0.01], np.float32),
        token_versions=np.array([3, 3, 4], np.int32),
        reward=1.1,
        finished=True,
        text="12",
    )
    t = Trajectory(
        traj_id="g1",
        prompt_id="train-1",
        group_id="g1",
        generator="gen-0",
        behavior_version=3,
        issued_version=2,
        prompt_ids=np.array([1, 7, 8], np.int32),
        samples=[s, s],
    )
    for k, v in over.items():
        setattr(t, k, v)
    return t


def test_trajectory_round_trip_keeps_every_field():
    t = _traj()
    fields = encode_trajectory(t)
    assert fields["reward_mean"] == "1.1000" and fields["n"] == 2  # readable in redis-cli
    back = decode_trajectory(_fields(fields), LIMITS)
    assert (back.traj_id, back.behavior_version, back.issued_version) == ("g1", 3, 2)
    np.testing.assert_array_equal(back.prompt_ids, t.prompt_ids)
    for a, b in zip(back.samples, t.samples):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.token_versions, b.token_versions)
        assert (a.reward, a.finished, a.text) == (b.reward, b.finished, b.text)
    assert back.retried is False and "retried" not in msgpack.unpackb(fields["data"])
    again = decode_trajectory(_fields(encode_trajectory(_traj(retried=True))), LIMITS)
    assert again.retried is True


def test_prompt_round_trip():
    w = PromptWork(
        prompt_id="train-3",
        group_id="g000000003",
        n=4,
        issued_version=7,
        item={"id": "train-3", "prompt": "1+2=", "answer": "3"},
    )
    back = decode_prompt(_fields(encode_prompt(w)), 10_000)
    assert back == w


def _mutated(mutate) -> dict[bytes, bytes]:
    fields = _fields(encode_trajectory(_traj()))
    body = msgpack.unpackb(fields[b"data"])
    mutate(fields, body)
    fields[b"data"] = msgpack.packb(body)
    return fields


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f, b: f.__setitem__(b"schema", b"99"), "schema"),
        (lambda f, b: b["samples"][0].__setitem__("reward", float("nan")), "reward: not finite"),
        (lambda f, b: b["samples"][1].__setitem__("reward", "high"), "wrong type str"),
        (
            lambda f, b: b["samples"][0]["logprobs"].__setitem__(
                "data", np.array([-0.5, np.inf, -1], np.float32).tobytes()
            ),
            "logprobs: not finite",
        ),
        (
            lambda f, b: b["samples"][0]["response_ids"].__setitem__(
                "data", np.array([5, VOCAB, 2], np.int32).tobytes()
            ),
            "outside the vocabulary",
        ),
        (
            lambda f, b: b["prompt_ids"].__setitem__(
                "data", np.array([-1, 7, 8], np.int32).tobytes()
            ),
            "prompt_ids: token id outside",
        ),
        (
            lambda f, b: b["samples"][0]["logprobs"].__setitem__("shape", [4]),
            "does not match shape",
        ),
        (
            lambda f, b: b["samples"][0]["logprobs"].__setitem__("dtype", "<f8"),
            "expected a <f4 array",
        ),
        (lambda f, b: b.__setitem__("samples", []), "no samples"),
        (lambda f, b: f.pop(b"traj_id"), "bad scalar field"),
    ],
)
def test_invalid_trajectories_are_rejected_with_a_reason(mutate, reason):
    with pytest.raises(WireError, match=reason):
        decode_trajectory(_mutated(mutate), LIMITS)


def test_corrupt_and_oversize_payloads_are_rejected_before_use():
    fields = _fields(encode_trajectory(_traj()))
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_trajectory(fields, WireLimits(max_bytes=10, vocab_size=VOCAB))
    fields[b"data"] = b"\xc1\xff\x00garbage"
    with pytest.raises(WireError, match="corrupt msgpack"):
        decode_trajectory(fields, LIMITS)


def test_pickle_is_never_accepted():
    import pickle

    fields = _fields(encode_trajectory(_traj()))
    fields[b"data"] = pickle.dumps({"samples": []})
    with pytest.raises(WireError):
        decode_trajectory(fields, LIMITS)


@pytest.mark.parametrize(
    "key, bad, reason",
    [
        ("logprobs", np.array([-0.5, 0.25, -1], np.float32), r"samples\[2\]\.logprobs: not finite"),
        ("response_ids", np.array([5, VOCAB, 2], np.int32), r"samples\[2\]\.response_ids: token"),
        ("token_versions", np.array([3, -1, 4], np.int32), r"samples\[2\]\.token_versions"),
    ],
)
def test_a_bad_value_in_a_later_sample_refuses_the_entry_and_names_that_sample(key, bad, reason):
    # the ranges are checked over the whole trajectory at once; the error still names the sample
    def mutate(f, b):
        b["samples"].append(dict(b["samples"][0], **{key: dict(b["samples"][0][key])}))
        b["samples"][2][key]["data"] = bad.tobytes()
        f[b"n"] = b"3"

    with pytest.raises(WireError, match=reason):
        decode_trajectory(_mutated(mutate), LIMITS)


def test_a_reward_over_the_limit_in_a_later_sample_is_refused():
    limits = WireLimits(max_bytes=1_000_000, vocab_size=VOCAB, max_abs_reward=2.0)
    big = _traj()
    big.samples = [big.samples[0], Sample(**{**vars(big.samples[0]), "reward": -2.5})]
    with pytest.raises(WireError, match=r"samples\[1\]\.reward: values outside \[-2.0, 2.0\]"):
        decode_trajectory(_fields(encode_trajectory(big)), limits)
    assert decode_trajectory(_fields(encode_trajectory(_traj())), limits).samples[1].reward == 1.1


def test_reward_parts_round_trip_and_stay_off_the_wire_when_absent():
    t = _traj()
    parts = {"math": 1.0, "format_ok": None}  # format_ok failed on this sample
    t.samples = [Sample(**{**vars(t.samples[0]), "reward_parts": parts}), t.samples[1]]
    fields = encode_trajectory(t)
    back = decode_trajectory(_fields(fields), LIMITS)
    assert [s.reward_parts for s in back.samples] == [parts, None]
    assert "reward_parts" not in msgpack.unpackb(fields["data"])["samples"][1]


@pytest.mark.parametrize(
    "parts, reason",
    [
        ({}, "not a mapping of 1 to 16 scores"),
        ({f"f{i}": 1.0 for i in range(17)}, "not a mapping of 1 to 16 scores"),  # past the bound
        ([1.0, 2.0], "not a mapping"),
        ({"Math!": 1.0}, r"reward_parts\['Math!'\]: not a short snake_case name"),
        ({"x" * 49: 1.0}, "not a short snake_case name"),
        ({"math": float("nan")}, r"reward_parts\['math'\]: not a finite score"),
        ({"math": 2e6}, "not a finite score within range"),  # |score| > max_abs_reward (1e6)
        ({"math": True}, "not a finite score"),
        ({"math": "1.0"}, "not a finite score"),
    ],
)
def test_bad_reward_parts_are_refused(parts, reason):
    with pytest.raises(WireError, match=reason):
        decode_trajectory(
            _mutated(lambda f, b: b["samples"][0].__setitem__("reward_parts", parts)), LIMITS
        )
