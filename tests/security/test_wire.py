"""Hostile trajectory and prompt entries against the decoders (broker/wire/schema.py, broker/wire/wire.py).

The attacker controls every byte a generator writes. Whatever it writes, decoding either returns a
valid entry or raises `WireError` (which readers dead-letter), and memory stays bounded."""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollflash.broker.wire.schema import (
    PromptWork,
    Sample,
    Trajectory,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
)
from rollflash.broker.wire.wire import WireError, WireLimits

VOCAB = 50
LIMITS = WireLimits(max_bytes=8_000_000, vocab_size=VOCAB, max_samples=4, max_abs_reward=100.0)


def _fields(d: dict) -> dict[bytes, bytes]:
    """What redis-py returns for an entry XADDed with `d`."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in d.items()}


def _sample(versions=(3, 3), reward=1.0) -> Sample:
    return Sample(
        np.array([5, 6], np.int32),
        np.array([-0.5, -1.0], np.float32),
        np.array(versions, np.int32),
        reward,
        True,
        "ab",
    )


def _valid(samples=None, behavior=3) -> dict[bytes, bytes]:
    t = Trajectory("g", "p", "g", "gen-0", behavior, 2, np.array([1, 2], np.int32), [])
    t.samples = samples or [_sample(), _sample()]
    return _fields(encode_trajectory(t))


def _with_body(fields: dict[bytes, bytes], mutate) -> dict[bytes, bytes]:
    body = msgpack.unpackb(fields[b"data"])
    mutate(body)
    return {**fields, b"data": msgpack.packb(body)}


def _array(dtype: str, shape: list[int], data: bytes) -> dict:
    return {"dtype": dtype, "shape": shape, "data": data}


def test_a_valid_entry_decodes():
    t = decode_trajectory(_valid(), LIMITS)
    assert (t.traj_id, t.behavior_version, len(t.samples)) == ("g", 3, 2)


def test_a_sample_decodes_the_same_with_or_without_optional_keys():
    """A single-turn sample takes the one-pass path; with an optional key (here env_errors: 0,
    which is also the default) it takes the full one, and both give the same sample."""
    plain = decode_trajectory(_valid(), LIMITS).samples[0]
    fuller = decode_trajectory(
        _with_body(_valid(), lambda b: b["samples"][0].__setitem__("env_errors", 0)), LIMITS
    ).samples[0]
    for name, value in vars(plain).items():
        other = getattr(fuller, name)
        if isinstance(value, np.ndarray):
            assert value.dtype == other.dtype and np.array_equal(value, other), name
        else:
            assert value == other and type(value) is type(other), name


# Each crafted entry names the attack and the reason code it must be dead-lettered with.
CRAFTED = {
    # numpy's reshape raised a plain ValueError for this, which escaped the reader
    "huge dimension with no data": (
        lambda b: b.__setitem__("prompt_ids", _array("<i4", [2**62, 0], b"")),
        "bad_shape",
    ),
    "rank-0 prompt ids": (
        lambda b: b.__setitem__("prompt_ids", _array("<i4", [], np.int32(1).tobytes())),
        "bad_shape",
    ),
    "rank-2 prompt ids": (
        lambda b: b.__setitem__("prompt_ids", _array("<i4", [1, 2], np.ones(2, "<i4").tobytes())),
        "bad_shape",
    ),
    "empty prompt ids": (
        lambda b: b.__setitem__("prompt_ids", _array("<i4", [0], b"")),
        "bad_shape",
    ),
    "dimension over the token cap": (
        lambda b: b.__setitem__("prompt_ids", _array("<i4", [1 << 17], b"\x01" * (4 << 17))),
        "bad_shape",
    ),
    "huge reward": (lambda b: b["samples"][0].__setitem__("reward", 1e300), "out_of_range"),
    "shape with a bool": (
        lambda b: b["samples"][0]["logprobs"].__setitem__("shape", [True, True]),
        "bad_type",
    ),
    "unknown top-level key": (lambda b: b.__setitem__("extra", 1), "unknown_key"),
    "unknown sample key": (lambda b: b["samples"][0].__setitem__("extra", 1), "unknown_key"),
    "array that is not a mapping": (
        lambda b: b["samples"][0].__setitem__("logprobs", [-0.5, -1.0]),
        "corrupt",
    ),
    "sample that is not a mapping": (lambda b: b["samples"].__setitem__(0, 7), "corrupt"),
    "too many samples": (lambda b: b.__setitem__("samples", b["samples"] * 3), "out_of_range"),
    # a single-turn sample is decided in one pass; anything odd in it gets the full checks
    "reward that is a bool": (lambda b: b["samples"][0].__setitem__("reward", True), "bad_type"),
    "reward that is NaN": (
        lambda b: b["samples"][0].__setitem__("reward", float("nan")),
        "out_of_range",
    ),  # fmt: skip
    "finished that is an int": (lambda b: b["samples"][0].__setitem__("finished", 1), "bad_type"),
    "text that is bytes": (lambda b: b["samples"][0].__setitem__("text", b"ab"), "bad_type"),
    "logprobs shorter than the ids": (
        lambda b: b["samples"][0].__setitem__("logprobs", _array("<f4", [1], b"\0\0\0\xbf")),
        "bad_shape",
    ),
    "nested lists in a known field": (
        lambda b: b["samples"][0].__setitem__("text", [[[]] * 1000] * 1000),
        "too_large",
    ),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_bodies_are_refused_with_their_reason(name):
    mutate, code = CRAFTED[name]
    with pytest.raises(WireError) as e:
        decode_trajectory(_with_body(_valid(), mutate), LIMITS)
    assert e.value.code == code, str(e.value)


def test_negative_token_versions_are_refused():
    fields = _valid(samples=[_sample(versions=(-1, 3)), _sample()], behavior=-1)
    with pytest.raises(WireError, match="token_versions") as e:
        decode_trajectory(fields, LIMITS)
    assert e.value.code == "out_of_range"


def test_behavior_version_must_be_the_oldest_token_version():
    # tokens from versions 1 and 3: claiming 3 would let stale data past the staleness check
    fields = _valid(samples=[_sample(versions=(1, 3)), _sample()], behavior=3)
    with pytest.raises(WireError, match="oldest token's version 1"):
        decode_trajectory(fields, LIMITS)
    assert decode_trajectory({**fields, b"behavior_version": b"1"}, LIMITS).behavior_version == 1


@pytest.mark.parametrize("n", [b"0", b"3", b"100000000000", b"-2", b"2.5"])
def test_n_must_match_the_samples_and_the_limit(n):
    with pytest.raises(WireError, match="trajectory"):
        decode_trajectory({**_valid(), b"n": n}, LIMITS)


BOMB = b"\x91" * 1000 + b"\x90"  # 1000 nested one-item lists
UNKNOWN_KEY = msgpack.packb({"extra": None})[:-1]  # map of 1 with key "extra", value left out


def _refused_with_bombs(body_before: bytes) -> WireError:
    """Decode a body that ends in an array of 65535 bombs (7.9 MB of nested lists cost 547 MB of
    RSS when decoded in full): it is refused with its peak memory under 40 MB; returns the
    error."""
    payload = body_before + b"\xdc\xff\xff" + BOMB * 0xFFFF
    fields = {**_valid(), b"data": payload[:7_900_000]}
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as e:
            decode_trajectory(fields, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40_000_000, f"decoding a refused entry peaked at {peak / 1e6:.0f} MB"
    return e.value


def test_an_unknown_key_is_refused_before_its_value_is_decoded():
    error = _refused_with_bombs(UNKNOWN_KEY)
    assert error.code == "unknown_key"


def test_a_bomb_under_an_unknown_sample_key_stops_at_the_object_cap():
    """A sample's fields are decoded whole before their keys are checked (broker/wire/wire.py
    `mapping`), so this bomb is decoded until the object cap stops it, not refused before: the
    cap, not the key check, bounds its memory."""
    prefix = msgpack.packb({"prompt_ids": _array("<i4", [2], np.ones(2, "<i4").tobytes())})
    body = b"\x82" + prefix[1:] + msgpack.packb("samples") + b"\x91" + UNKNOWN_KEY  # 1 sample
    error = _refused_with_bombs(body)
    assert error.code in ("too_large", "corrupt"), str(error)


@pytest.mark.parametrize("where", ["sample", "array"])
def test_a_repeated_key_in_a_mapping_decoded_whole_is_refused(where):
    """A msgpack map may repeat a key; a dict would keep the last value silently."""
    sample = {"response_ids": _array("<i4", [2], np.array([5, 6], "<i4").tobytes()),
              "logprobs": _array("<f4", [2], np.array([-0.5, -1.0], "<f4").tobytes()),
              "token_versions": _array("<i4", [2], np.array([3, 3], "<i4").tobytes()),
              "reward": 1.0, "finished": True, "text": "ab"}  # fmt: skip
    packed = msgpack.packb(sample)
    if where == "sample":  # the map header says 7 entries; the last repeats "reward"
        packed = b"\x87" + packed[1:] + msgpack.packb("reward") + msgpack.packb(99.0)
    else:  # logprobs' array map gets a second "data"
        key = msgpack.packb("logprobs")
        at = packed.index(key) + len(key)
        inner = msgpack.packb(sample["logprobs"])
        packed = (packed[:at] + b"\x84" + inner[1:] + msgpack.packb("data") + msgpack.packb(b"")
                  + packed[at + len(inner):])  # fmt: skip
    prompt = msgpack.packb({"prompt_ids": _array("<i4", [2], np.array([1, 2], "<i4").tobytes())})
    body = (b"\x83" + prompt[1:] + msgpack.packb("issued_version") + msgpack.packb(2)
            + msgpack.packb("samples") + b"\x91" + packed)  # fmt: skip
    fields = {**_valid(), b"data": body, b"n": b"1"}
    with pytest.raises(WireError, match="repeated") as e:
        decode_trajectory(fields, LIMITS)
    assert e.value.code == "unknown_key"


def test_nested_lists_under_a_known_key_hit_the_object_cap_with_bounded_memory():
    # a prompt's item is a free-form mapping: 3.6M empty lists (~3.6 MB encoded) inside it
    nested = msgpack.packb({"item": {"x": [[[]] * 60_000] * 60}})
    fields = {**_fields(encode_prompt(PromptWork("p", "g", 2, 0, {}))), b"data": nested}
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="msgpack objects") as e:
            decode_prompt(fields, 8_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.code == "too_large"
    assert peak < 80_000_000, f"peaked at {peak / 1e6:.0f} MB"


def test_prompt_entries_are_validated_too():
    w = PromptWork("p", "g", 2, 0, {"prompt": "1+1="})
    good = _fields(encode_prompt(w))
    assert decode_prompt(good, 10_000) == w
    for bad in (
        {**good, b"n": b"0"},
        {**good, b"issued_version": b"-1"},
        {**good, b"data": msgpack.packb({"item": {}, "extra": 1})},
        {**good, b"data": msgpack.packb({"item": [1]})},
        {**good, b"prompt_id": b"\xff\xfe"},
    ):
        with pytest.raises(WireError):
            decode_prompt(bad, 10_000)


def _decode_any(fields: dict[bytes, bytes]) -> None:
    """Decode as a trajectory and as a prompt: only WireError may come out."""
    for decode in (
        lambda: decode_trajectory(fields, LIMITS),
        lambda: decode_prompt(fields, 1_000_000),
    ):
        try:
            decode()
        except WireError:
            pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=msgpack_values,
    scalars=st.dictionaries(
        st.sampled_from(
            ["schema", "traj_id", "n", "behavior_version", "prompt_id", "issued_version"]
        ),
        st.binary(max_size=12),
        max_size=6,
    ),
)
def test_random_msgpack_only_ever_raises_wire_error(body, scalars):
    fields = {**_valid(), b"data": msgpack.packb(body)}
    fields.update({k.encode(): v for k, v in scalars.items()})
    _decode_any(fields)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_valid_entries_only_ever_raise_wire_error(data):
    raw = bytearray(_valid()[b"data"])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    tracemalloc.start()
    try:
        _decode_any({**_valid(), b"data": bytes(raw)})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50_000_000
