"""Bounded decoding of untrusted msgpack: what a hostile entry can cost a reader is capped.

Anything in Redis that a generator wrote is untrusted (docs/security.md). A reader of such an
entry goes through `BodyReader`, which reads a msgpack body one object at a time:
- the payload's byte size is checked against `WireLimits.max_bytes` before anything is decoded;
- a body's mapping is read key by key and a key outside the declared set is refused *before*
  its value is decoded, so no unknown field costs memory;
- the small mappings read for every sample (a sample's fields, an array's dtype, shape and data)
  are decoded whole by msgpack's C decoder (`mapping`; a trajectory's samples at once with
  `mappings`) and their keys checked afterwards: reading them key by key cost several times
  more, and what an unknown key's value can cost is capped by the byte and object limits either
  way;
- every decoded container counts towards `WireLimits.max_objects`, so nested lists cannot turn a
  few megabytes into gigabytes of Python objects, and a mapping decoded whole may not repeat a
  key;
- arrays travel as {"dtype", "shape", "data"} with raw little-endian bytes; their dtype, rank and
  every dimension are declared and capped, and the byte length must match before numpy sees it;
- any failure, whatever its cause, is a `WireError` whose message is a one-line reason and whose
  `code` is a short stable category (what `rollctl status` counts dead letters by).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

DTYPES: dict[str, np.dtype[Any]] = {
    "<i4": np.dtype("<i4"),
    "<f4": np.dtype("<f4"),
    "<i8": np.dtype("<i8"),
    "|u1": np.dtype("|u1"),
}


class WireError(ValueError):
    """An entry that cannot be accepted; the message is the dead-letter reason and `code` its
    category: corrupt, too_large, schema, unknown_key, bad_type, bad_shape, out_of_range."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WireLimits:
    """What a reader accepts. The learner derives them from the run config (`for_config`)."""

    max_bytes: int  # encoded size of the msgpack body (redis.max_payload_bytes)
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size) (None: not checked)
    max_tokens: int = 1 << 16  # longest id array: a prompt, or a response with its observations
    max_samples: int = 1024  # samples in one trajectory entry
    max_abs_reward: float = 1e6  # |reward| of a sample and of each turn
    max_objects: int = 200_000  # msgpack containers and their items in one body
    max_id_bytes: int = 256  # an id, a generator name or a MAC (the readable fields)
    max_text_bytes: int = 1 << 16  # a sample's decoded `text`
    max_reward_parts: int = 16  # reward functions whose scores one sample carries

    @classmethod
    def for_config(cls, cfg: Any, vocab_size: int | None) -> WireLimits:
        """The learner's limits: at most a group of n samples per entry (one with prompt
        replication), rewards within `reward.max_abs_reward`, a text of at most 32 bytes per
        token of the longest response the config allows (and at least 64 KiB)."""
        rollout = cfg.rollout
        longest = max(rollout.max_new_tokens, rollout.max_episode_tokens)
        return cls(
            max_bytes=cfg.redis.max_payload_bytes,
            vocab_size=vocab_size,
            max_samples=rollout.num_return_sequences,
            max_abs_reward=cfg.reward.max_abs_reward,
            max_text_bytes=max(1 << 16, 32 * longest),
        )


class BodyReader:
    """Reads one msgpack object (a body) incrementally under `limits`; see the module docstring."""

    def __init__(self, raw: Any, limits: WireLimits):
        if not isinstance(raw, bytes):
            raise WireError("data field missing", "schema")
        if len(raw) > limits.max_bytes:
            raise WireError(
                f"payload of {len(raw)} bytes exceeds the limit of {limits.max_bytes}", "too_large"
            )
        self.limits = limits
        self.objects = 0
        self._what = "body"  # what is being read (a repeated key's error names it)
        self._u = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=max(len(raw), 1),
            max_bin_len=limits.max_bytes,
            max_str_len=limits.max_bytes,
            max_array_len=limits.max_objects,
            max_map_len=limits.max_objects,
            max_ext_len=0,
            list_hook=self._count_list,
            object_pairs_hook=self._count_map,
        )
        self._u.feed(raw)

    def _count(self, n: int) -> None:
        self.objects += n
        if self.objects > self.limits.max_objects:
            raise WireError(f"more than {self.limits.max_objects} msgpack objects", "too_large")

    def _count_list(self, value: list) -> list:
        self._count(1 + len(value))
        return value

    def _count_map(self, pairs: list[tuple[Any, Any]]) -> dict:
        self.objects += 1 + 2 * len(pairs)  # `_count`, inlined: this runs for every mapping
        if self.objects > self.limits.max_objects:
            raise WireError(f"more than {self.limits.max_objects} msgpack objects", "too_large")
        value = dict(pairs)
        if len(value) != len(pairs):
            seen: set[Any] = set()
            for key, _ in pairs:
                if key in seen:
                    raise WireError(f"{self._what}: key {key!r} repeated", "unknown_key")
                seen.add(key)
        return value

    def _read(self, read: Callable[[], Any], what: str, expected: str) -> Any:
        """`read()` from the unpacker; a msgpack failure becomes a `corrupt` WireError (a
        WireError raised by the counting hooks passes through as it is)."""
        self._what = what  # a repeated key in what `read` decodes whole is named after it
        try:
            return read()
        except WireError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise WireError(
                f"corrupt msgpack: {what} is not {expected} ({e.__class__.__name__})", "corrupt"
            ) from None

    def fields(self, what: str, allowed: frozenset[str]) -> Iterator[str]:
        """Iterate over a mapping's keys; the caller must read (or `skip`) each key's value before
        the next key. A key outside `allowed` is refused before its value is decoded."""
        n = self._read(self._u.read_map_header, what, "a mapping")
        self._count(1 + 2 * n)
        seen: set[str] = set()
        unpack = self._u.unpack
        for _ in range(n):
            key = self._read(unpack, what, "a string key")
            if key.__class__ is not str or key not in allowed or key in seen:
                _refuse_key(what, key, seen)
            seen.add(key)
            yield key

    def mappings(self, what: str, max_len: int) -> list[dict[Any, Any]]:
        """The next array, of at most `max_len` mappings, each decoded whole (`mapping`); the
        length is checked before any item is decoded."""
        n = self._read(self._u.read_array_header, what, "an array")
        if n > max_len:
            raise WireError(f"{what}: {n} items, more than {max_len}", "out_of_range")
        self._count(1 + n)
        unpack = self._u.unpack
        items = self._read(lambda: [unpack() for _ in range(n)], what, "an array of mappings")
        for item in items:
            if item.__class__ is not dict:
                raise WireError(f"corrupt msgpack: an item of {what} is not a mapping", "corrupt")
        return items

    def typed(self, what: str, kind: type | tuple[type, ...], suffix: str = "") -> Any:
        """The next object, which must be a scalar of `kind` (bool is not an int here); errors
        name it `what + suffix` (built only when one is raised)."""
        return typed(
            self._read(self._u.unpack, what + suffix, "a msgpack value"), what, kind, suffix
        )

    def mapping(self, what: str) -> dict[Any, Any]:
        """The next object, which must be a mapping, decoded whole (see the module docstring)."""
        value = self._read(self._u.unpack, what, "a mapping")
        if value.__class__ is not dict:
            raise WireError(f"corrupt msgpack: {what} is not a mapping", "corrupt")
        return value

    def array(self, what: str, dtype: str, ndim: int, max_dim: int) -> np.ndarray:
        """A packed array of `dtype` with exactly `ndim` dimensions, each at most `max_dim`."""
        return array_from(self.mapping(what), what, dtype, ndim, max_dim)

    def finish(self) -> None:
        """Refuse bytes after the body's one object."""
        try:
            self._u.skip()
        except msgpack.OutOfData:
            return
        except Exception:
            pass
        raise WireError("corrupt msgpack: trailing data after the body", "corrupt")


_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
MAX_DIMS = 8  # dimensions an array's shape may have


def typed(value: Any, what: str, kind: type | tuple[type, ...], suffix: str = "") -> Any:
    """`value` if it is a scalar of `kind` (bool is not an int here); errors name it
    `what + suffix` (built only when one is raised)."""
    if value.__class__ is kind:  # the common case, and never bool for int
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise WireError(f"{what}{suffix}: wrong type {type(value).__name__}", "bad_type")
    return value


def known_keys(value: dict[Any, Any], what: str, allowed: frozenset[str]) -> None:
    """Refuse a decoded mapping with a key outside `allowed` (naming the first one)."""
    if not value.keys() <= allowed:
        _refuse_key(what, next(k for k in value if k not in allowed), set())


def array_from(value: dict[Any, Any], what: str, dtype: str, ndim: int, max_dim: int) -> np.ndarray:
    """A decoded packed array {dtype, shape, data} of `dtype` with exactly `ndim` dimensions, each
    at most `max_dim`, as a zero-copy view of its bytes."""
    if value.__class__ is not dict:
        raise WireError(f"corrupt msgpack: {what} is not a mapping", "corrupt")
    shape, data, item = value.get("shape"), value.get("data"), DTYPES[dtype].itemsize
    if (  # a well-formed vector: the common case, decided in one expression
        ndim == 1
        and len(value) == 3
        and value.get("dtype") == dtype
        and shape.__class__ is list
        and len(shape) == 1
        and shape[0].__class__ is int
        and 0 <= shape[0] <= max_dim
        and data.__class__ is bytes
        and len(data) == shape[0] * item
    ):
        return np.frombuffer(data, dtype=DTYPES[dtype])
    return _array_checked(value, what, dtype, ndim, max_dim)


def _array_checked(
    value: dict[Any, Any], what: str, dtype: str, ndim: int, max_dim: int
) -> np.ndarray:
    """`array_from` by checking every part in turn: the one path for arrays of other shapes and
    for refusals; tests/unit/test_wire_fast_paths.py proves the fast path gives the same."""
    shape, item = value.get("shape"), DTYPES[dtype].itemsize
    known_keys(value, what, _ARRAY_KEYS)
    if len(value) != 3 or typed(value["dtype"], what, str, ".dtype") != dtype:
        raise WireError(f"{what}: expected a {dtype} array", "bad_type")
    data = typed(value["data"], what, bytes, ".data")
    if shape.__class__ is not list:
        raise WireError(f"corrupt msgpack: {what} is not an array", "corrupt")
    if len(shape) > MAX_DIMS:
        raise WireError(f"{what}: {len(shape)} items, more than {MAX_DIMS}", "out_of_range")
    for dim in shape:
        typed(dim, what, int, ".shape")
    if len(shape) != ndim or not all(0 <= s <= max_dim for s in shape):
        raise WireError(
            f"{what}: shape {shape} is not {ndim}-D with dimensions <= {max_dim}", "bad_shape"
        )
    if len(data) != math.prod(shape) * item:
        raise WireError(f"{what}: data length does not match shape {shape}", "bad_shape")
    flat = np.frombuffer(data, dtype=DTYPES[dtype])  # zero-copy: a view of the body's bytes
    return flat if ndim == 1 else flat.reshape(shape)


def _refuse_key(what: str, key: Any, seen: set[str]) -> None:
    if isinstance(key, str) and key in seen:
        raise WireError(f"{what}: key {key!r} repeated", "unknown_key")
    raise WireError(f"{what}: unknown key {repr(key)[:40]}", "unknown_key")


def pack_array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(a, dtype=DTYPES[dtype])
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def check_range(values: np.ndarray, low: float, high: float, what: str) -> None:
    """Every value finite and in [low, high]."""
    if values.size and (
        not np.all(np.isfinite(values)) or values.min() < low or values.max() > high
    ):
        raise WireError(f"{what}: values outside [{low}, {high}] or not finite", "out_of_range")


_NAME = re.compile(r"[a-z][a-z0-9_]{0,47}")


def check_name(value: str, what: str) -> str:
    """A short snake_case name (it becomes part of a metric name, e.g. `reward/<reason>`)."""
    if not _NAME.fullmatch(value):
        raise WireError(f"{what}: not a short snake_case name", "out_of_range")
    return value
