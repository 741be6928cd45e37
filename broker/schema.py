"""The wire schema: what a prompt entry and a trajectory entry hold, and how they are encoded.

Rules (ARCHITECTURE.md, "Wire rules"):
- msgpack only, never pickle; every entry carries `schema` = SCHEMA_VERSION.
- Arrays travel as {"dtype", "shape", "data"} with raw little-endian bytes.
- The encoded size is checked against a limit *before* msgpack decodes anything, and msgpack is
  given explicit length limits, so a hostile entry cannot make a reader allocate unbounded memory.
- Decoding validates types, finiteness and token-id ranges; any failure raises `WireError` with a
  one-line reason, which callers put in the dead-letter stream.

A trajectory entry is one finished group: the n samples a generator drew for one prompt. A sample
of a multi-turn episode (envs/episode.py) adds `loss_mask`, `turn_starts`, `turn_rewards` and
`turn_states`; they are optional keys, so single-turn entries are unchanged and SCHEMA_VERSION
stays 1 (a reader that predates them would ignore them, and train on observation tokens). So are
`retried` (true when the prompt had been delivered before) and a sample's `env_errors` (present
when its episode met environment or tool exceptions). Its small
scalar fields (`traj_id`, `behavior_version`, `reward_mean`, ...) sit beside the msgpack `data`
field so that `redis-cli XRANGE` shows them readably.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1

_MAX_ITEMS = 65_536  # msgpack array/map length limit: far above any group size or field count
_DTYPES = {
    "<i4": np.dtype("<i4"),
    "<f4": np.dtype("<f4"),
    "<i8": np.dtype("<i8"),
    "|u1": np.dtype("|u1"),
}


class WireError(ValueError):
    """An entry that cannot be accepted; the message is the dead-letter reason."""


@dataclass
class PromptWork:
    """One unit of work on the prompts stream: sample `n` responses for `item`."""

    prompt_id: str  # stable id of the task item, e.g. "train-000123"
    group_id: str  # unique per issue of a prompt; the trajectory id derives from it
    n: int  # samples to draw (the group size)
    issued_version: int  # learner version when the prompt was admitted
    item: dict[str, Any]  # the task item (prompt text, answer, ...) as plain msgpack types
    sample_index: int = -1  # with prompt replication: which sample of the group (-1: all n)
    retried: bool = False  # set by the reader, not on the wire: delivered before (RunBroker)


@dataclass
class Sample:
    """One sampled response."""

    response_ids: np.ndarray  # [T] int32, generated tokens (EOS included when the sample stopped)
    logprobs: np.ndarray  # [T] float32, behaviour log-probability of each generated token
    token_versions: np.ndarray  # [T] int32, weight version that produced each token
    reward: float
    finished: bool  # True if the response ended with EOS, False if cut at max_new_tokens
    text: str = ""  # decoded response, kept for inspection and reward debugging
    # multi-turn episodes only (absent on the wire for single-turn samples; see _decode_turns):
    loss_mask: np.ndarray | None = None  # [T] uint8, 1 on model tokens, 0 on observation tokens
    turn_starts: np.ndarray | None = None  # [K] int32, response index where turn k's action starts
    turn_rewards: np.ndarray | None = None  # [K] float32, reward of each turn (sum = reward)
    turn_states: np.ndarray | None = None  # [K] int64, state key each turn acted in (GiGPO groups)
    env_errors: int = 0  # environment / tool exceptions in the episode (absent on the wire if 0)


@dataclass
class Trajectory:
    """One finished group of samples for one prompt."""

    traj_id: str
    prompt_id: str
    group_id: str
    generator: str
    behavior_version: int  # weights the group started with (min over its tokens)
    issued_version: int
    prompt_ids: np.ndarray  # [P] int32
    samples: list[Sample] = field(default_factory=list)
    retried: bool = False  # its prompt had been delivered before: a generator died holding it,
    #                        or Redis forgot an acknowledgement (so maybe a duplicate)

    @property
    def reward_mean(self) -> float:
        return float(np.mean([s.reward for s in self.samples])) if self.samples else 0.0

    @classmethod
    def for_work(
        cls, work: PromptWork, samples: list[Sample], prompt_ids: Any, generator: str, version: int
    ) -> Trajectory:
        """The answer to one prompt entry: traj_id is the group id (plus `/k` for replicated
        sample k), and the behaviour version is the oldest token's (`version` if none)."""
        oldest = min(
            (int(s.token_versions.min()) for s in samples if s.token_versions.size), default=version
        )
        traj_id = work.group_id if work.sample_index < 0 else f"{work.group_id}/{work.sample_index}"
        return cls(
            traj_id=traj_id,
            prompt_id=work.prompt_id,
            group_id=work.group_id,
            generator=generator,
            behavior_version=oldest,
            issued_version=work.issued_version,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            samples=samples,
            retried=work.retried,
        )


def pack_array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(a, dtype=_DTYPES[dtype])
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def unpack_array(d: Any, dtype: str, what: str) -> np.ndarray:
    if not isinstance(d, dict) or d.get("dtype") != dtype:
        raise WireError(f"{what}: expected a {dtype} array")
    shape, data = d.get("shape"), d.get("data")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(f"{what}: bad shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * _DTYPES[dtype].itemsize:
        raise WireError(f"{what}: data length does not match shape {shape}")
    return np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(shape)


def _unpackb(raw: Any, max_bytes: int) -> Any:
    if not isinstance(raw, bytes):
        raise WireError("data field missing")
    if len(raw) > max_bytes:
        raise WireError(f"payload of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=_MAX_ITEMS,
            max_map_len=_MAX_ITEMS,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise WireError(f"corrupt msgpack ({e.__class__.__name__})") from None


def _check_schema(fields: dict[bytes, bytes]) -> None:
    schema = fields.get(b"schema")
    if schema != str(SCHEMA_VERSION).encode():
        raise WireError(f"schema {schema!r} is not the supported {SCHEMA_VERSION}")


def _get(d: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise WireError(f"{what}.{key}: wrong type {type(value).__name__}")
    return value


def encode_prompt(w: PromptWork) -> dict[str, Any]:
    data = msgpack.packb({"item": w.item}, use_bin_type=True)
    return {
        "schema": SCHEMA_VERSION,
        "prompt_id": w.prompt_id,
        "group_id": w.group_id,
        "n": w.n,
        "issued_version": w.issued_version,
        "sample_index": w.sample_index,
        "data": data,
    }


def decode_prompt(fields: dict[bytes, bytes], max_bytes: int) -> PromptWork:
    _check_schema(fields)
    body = _unpackb(fields.get(b"data"), max_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("item"), dict):
        raise WireError("prompt: item missing")
    try:
        return PromptWork(
            prompt_id=fields[b"prompt_id"].decode(),
            group_id=fields[b"group_id"].decode(),
            n=int(fields[b"n"]),
            issued_version=int(fields[b"issued_version"]),
            item=body["item"],
            sample_index=int(fields.get(b"sample_index", -1)),
        )
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"prompt: bad scalar field ({e})") from None


_TURN_FIELDS = (
    ("loss_mask", "|u1"),
    ("turn_starts", "<i4"),
    ("turn_rewards", "<f4"),
    ("turn_states", "<i8"),
)


def _encode_sample(s: Sample) -> dict[str, Any]:
    out = {
        "response_ids": pack_array(s.response_ids, "<i4"),
        "logprobs": pack_array(s.logprobs, "<f4"),
        "token_versions": pack_array(s.token_versions, "<i4"),
        "reward": float(s.reward),
        "finished": bool(s.finished),
        "text": s.text,
    }
    for name, dtype in _TURN_FIELDS:
        if getattr(s, name) is not None:
            out[name] = pack_array(getattr(s, name), dtype)
    if s.env_errors:
        out["env_errors"] = int(s.env_errors)
    return out


def encode_trajectory(t: Trajectory) -> dict[str, Any]:
    samples = [_encode_sample(s) for s in t.samples]
    body = {
        "prompt_ids": pack_array(t.prompt_ids, "<i4"),
        "issued_version": t.issued_version,
        "samples": samples,
    }
    if t.retried:  # optional, like the multi-turn keys
        body["retried"] = True
    return {
        "schema": SCHEMA_VERSION,
        "traj_id": t.traj_id,
        "prompt_id": t.prompt_id,
        "group_id": t.group_id,
        "behavior_version": t.behavior_version,
        "generator": t.generator,
        "n": len(t.samples),
        "reward_mean": f"{t.reward_mean:.4f}",
        "data": msgpack.packb(body, use_bin_type=True),
    }


def _decode_sample(s: Any, i: int) -> Sample:
    what = f"samples[{i}]"
    if not isinstance(s, dict):
        raise WireError(f"{what}: not a mapping")
    ids = unpack_array(s.get("response_ids"), "<i4", f"{what}.response_ids")
    logprobs = unpack_array(s.get("logprobs"), "<f4", f"{what}.logprobs")
    versions = unpack_array(s.get("token_versions"), "<i4", f"{what}.token_versions")
    if not (ids.ndim == 1 and ids.shape == logprobs.shape == versions.shape):
        raise WireError(f"{what}: response_ids, logprobs and token_versions differ in shape")
    reward = _get(s, "reward", (int, float), what)
    if not math.isfinite(reward):
        raise WireError(f"{what}.reward: not finite ({reward})")
    if not np.all(np.isfinite(logprobs)) or np.any(logprobs > 1e-4):
        raise WireError(f"{what}.logprobs: not finite or positive")
    env_errors = s.get("env_errors", 0)
    if type(env_errors) is not int or not 0 <= env_errors < 2**31:
        raise WireError(f"{what}.env_errors: not a count")
    return Sample(
        response_ids=ids,
        logprobs=logprobs,
        token_versions=versions,
        reward=float(reward),
        finished=_get(s, "finished", bool, what),
        text=_get(s, "text", str, what),
        **_decode_turns(s, ids.shape[0], what),
        env_errors=env_errors,
    )


def _decode_turns(s: dict, length: int, what: str) -> dict[str, np.ndarray]:
    """The optional multi-turn arrays: all four or none; loss_mask is 0/1 over the response, turn
    starts strictly increase inside it and each starts on a model token, rewards are finite."""
    present = {name: s.get(name) is not None for name, _ in _TURN_FIELDS}
    if not any(present.values()):
        return {}
    if not all(present.values()):
        missing = [n for n, p in present.items() if not p]
        raise WireError(f"{what}: multi-turn fields incomplete, missing {', '.join(missing)}")
    out = {name: unpack_array(s[name], dtype, f"{what}.{name}") for name, dtype in _TURN_FIELDS}
    mask, starts = out["loss_mask"], out["turn_starts"]
    if mask.shape != (length,) or np.any(mask > 1):
        raise WireError(f"{what}.loss_mask: must be 0/1 with the response's shape")
    k = starts.shape
    if len(k) != 1 or k[0] < 1 or out["turn_rewards"].shape != k or out["turn_states"].shape != k:
        raise WireError(f"{what}: turn_starts, turn_rewards and turn_states must be [K], K >= 1")
    if (
        np.any(np.diff(starts) <= 0)
        or starts[0] < 0
        or starts[-1] >= length
        or not np.all(mask[starts] == 1)
    ):
        raise WireError(f"{what}.turn_starts: not increasing model-token positions")
    if not np.all(np.isfinite(out["turn_rewards"])):
        raise WireError(f"{what}.turn_rewards: not finite")
    return out


def decode_trajectory(fields: dict[bytes, bytes], max_bytes: int, vocab_size: int) -> Trajectory:
    """Decode and validate one trajectory entry; raises WireError with the reason."""
    _check_schema(fields)
    body = _unpackb(fields.get(b"data"), max_bytes)
    if not isinstance(body, dict):
        raise WireError("trajectory: body is not a mapping")
    raw_samples = _get(body, "samples", list, "trajectory")
    samples = [_decode_sample(s, i) for i, s in enumerate(raw_samples)]
    prompt_ids = unpack_array(body.get("prompt_ids"), "<i4", "prompt_ids")
    for name, ids in [("prompt_ids", prompt_ids)] + [
        (f"samples[{i}].response_ids", s.response_ids) for i, s in enumerate(samples)
    ]:
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise WireError(f"{name}: token id outside the vocabulary [0, {vocab_size})")
    if not samples:
        raise WireError("trajectory: no samples")
    try:
        return Trajectory(
            traj_id=fields[b"traj_id"].decode(),
            prompt_id=fields[b"prompt_id"].decode(),
            group_id=fields[b"group_id"].decode(),
            generator=fields[b"generator"].decode(),
            behavior_version=int(fields[b"behavior_version"]),
            issued_version=_get(body, "issued_version", int, "trajectory"),
            prompt_ids=prompt_ids,
            samples=samples,
            retried=body.get("retried", False) is True,
        )
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"trajectory: bad scalar field ({e})") from None
