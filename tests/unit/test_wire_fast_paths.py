"""The decoder's fast paths (broker/wire/schema.py `_decode_sample`, broker/wire/wire.py `array_from`) give
what the checked paths give, on well-formed and malformed input alike: the same value, or a
refusal with the same reason and code. The fast paths exist for speed only; this property is
what lets them stay beside the checked paths."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflash.broker.wire.schema import Sample, _decode_sample, _decode_sample_checked
from rollflash.broker.wire.wire import WireError, WireLimits, _array_checked, array_from

LIMITS = WireLimits(max_bytes=1 << 20, vocab_size=50, max_tokens=6, max_text_bytes=40)
ITEM = {"<i4": 4, "<f4": 4}


def outcome(decode, *args):
    """What a decode gives: its value, or the refusal (every exception, not only WireError)."""
    try:
        return ("value", decode(*args))
    except WireError as e:
        return ("refused", str(e), e.code)
    except Exception as e:  # a checked path must not crash where the fast path refuses
        return ("crashed", type(e).__name__, str(e))


def same(a, b) -> bool:
    if a[0] != "value" or b[0] != "value":
        return a == b
    x, y = a[1], b[1]
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    assert isinstance(x, Sample) and isinstance(y, Sample)
    for name in vars(x):
        u, v = getattr(x, name), getattr(y, name)
        if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
            if not same(("value", u), ("value", v)):
                return False
        elif not (u == v or (isinstance(u, float) and math.isnan(u) and math.isnan(v))):
            return False
    return True


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True), st.text(max_size=3)
)


@st.composite
def packed(draw, dtype: str):
    """A packed array {dtype, shape, data}: usually well formed, often bent in one place."""
    n = draw(st.integers(0, 8))  # above max_tokens (6) too
    shape = draw(
        st.one_of(
            st.just([n]),
            st.just([n]),
            st.lists(st.one_of(st.integers(-1, 4), scalars), max_size=10),
            scalars,
        )
    )
    size = n * ITEM[dtype] + draw(st.sampled_from([0, 0, 0, -1, 1, 4]))
    value = {
        "dtype": draw(st.sampled_from([dtype, dtype, dtype, "<i4", "<f4", "<i8", 4])),
        "shape": shape,
        "data": draw(
            st.one_of(st.just(bytes(max(size, 0))), st.just(bytes(max(size, 0))), scalars)
        ),
    }
    for key in draw(st.lists(st.sampled_from(["dtype", "shape", "data"]), max_size=1)):
        del value[key]
    if draw(st.integers(0, 9)) == 0:
        value["extra"] = 1
    return value


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["<i4", "<f4"]).flatmap(lambda d: st.tuples(st.just(d), packed(d))))
def test_array_from_fast_path_equals_the_checked_path(case):
    dtype, value = case
    for ndim in (1, 2):
        fast = outcome(array_from, value, "a", dtype, ndim, 6)
        assert same(fast, outcome(_array_checked, value, "a", dtype, ndim, 6)), (value, ndim)


@st.composite
def sample_fields(draw):
    """A single-turn sample's fields in any order: usually well formed, often bent; sometimes a
    field missing or one more (a known optional one, or an unknown one)."""
    n = draw(st.integers(0, 3))
    good = {
        "response_ids": {"dtype": "<i4", "shape": [n], "data": bytes(4 * n)},
        "logprobs": {"dtype": "<f4", "shape": [n], "data": bytes(4 * n)},
        "token_versions": {"dtype": "<i4", "shape": [n], "data": bytes(4 * n)},
        "reward": draw(st.one_of(st.floats(allow_nan=True), st.integers(-5, 5))),
        "finished": True,
        "text": draw(st.text(max_size=12)),  # over 40 // 4 characters takes the checked path
    }
    bent = {
        "response_ids": packed("<i4"),
        "logprobs": packed("<f4"),
        "token_versions": packed("<i4"),
        "reward": scalars,
        "finished": scalars,
        "text": st.one_of(scalars, st.text(min_size=38, max_size=44)),
    }
    fields = {}
    for key in draw(st.permutations(list(good))):
        fields[key] = draw(bent[key]) if draw(st.integers(0, 3)) == 0 else good[key]
    if draw(st.integers(0, 7)) == 0:
        del fields[draw(st.sampled_from(sorted(fields)))]
    if draw(st.integers(0, 7)) == 0:
        fields[draw(st.sampled_from(["env_errors", "bogus"]))] = 0
    return fields


@settings(max_examples=300, deadline=None)
@given(sample_fields())
def test_sample_fast_path_equals_the_checked_path(fields):
    fast = outcome(_decode_sample, fields, "s", LIMITS)
    assert same(fast, outcome(_decode_sample_checked, fields, "s", LIMITS)), fields


def test_the_generators_reach_both_outcomes_of_each_path():
    # the property above is only as good as its inputs: a well-formed sample takes the fast
    # path, and a bent one is refused, with the same reason either way
    ok = {
        "response_ids": {"dtype": "<i4", "shape": [1], "data": bytes(4)},
        "logprobs": {"dtype": "<f4", "shape": [1], "data": bytes(4)},
        "token_versions": {"dtype": "<i4", "shape": [1], "data": bytes(4)},
        "reward": 1,
        "finished": False,
        "text": "7",
    }
    value = outcome(_decode_sample, ok, "s", LIMITS)
    assert value[0] == "value" and value[1].reward == 1.0 and value[1].reward.__class__ is float
    bent = {**ok, "finished": 1}
    assert outcome(_decode_sample, bent, "s", LIMITS) == (
        "refused",
        "s.finished: wrong type int",
        "bad_type",
    )
