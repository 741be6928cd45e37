"""The wire schema: what a prompt entry and a trajectory entry hold, and how they are encoded.

Rules (ARCHITECTURE.md, "Wire rules"):
- msgpack only, never pickle; every entry carries `schema` = SCHEMA_VERSION.
- Arrays travel as {"dtype", "shape", "data"} with raw little-endian bytes.
- Readers decode through broker/wire/wire.py's `BodyReader`: the size is checked before anything is
  decoded, an unknown key of a body is refused before its value is decoded (a sample's fields and
  an array's are decoded whole, then checked), and the object count is capped, so a hostile entry
  cannot make a reader allocate unbounded memory.
- Every field has a declared type, dtype, rank and range (`WireLimits`): ids are 1-D with at least
  one element, token ids lie in the vocabulary, token versions are >= 0 and `behavior_version` is
  the oldest of them, rewards are finite and within `reward.max_abs_reward`, a trajectory holds 1
  to n samples and says so in `n`. Any failure, whatever its cause, raises `WireError` with a
  one-line reason and a category (`code`), which readers put in the dead-letter stream.

A trajectory entry is one finished group: the n samples a generator drew for one prompt (or one
sample, with prompt replication). A sample of a multi-turn episode (envs/episode.py) adds
`loss_mask`, `turn_starts`, `turn_rewards` and `turn_states`, all four or none; `retried` (true
when the prompt had been delivered before) and a sample's `env_errors` (environment or tool
exceptions met by its episode, when there were any), `reward_failure` (why its reward failed:
a short snake_case reason such as `code_timeout`), `reward_parts` (each reward function's score,
None where it failed, with two or more functions or a failure) and `reward_abstained` (the
reward functions that abstained on it) are optional too.
Readers refuse keys they do not know, so a new field needs a new SCHEMA_VERSION. The small scalar
fields (`traj_id`, `behavior_version`, `reward_mean`, ...) sit beside the msgpack `data` field so
that `redis-cli XRANGE` shows them readably; so does `mac`, the learner's MAC over the prompt entry
(broker/channels/provenance.py), which a generator copies from the prompt to its trajectory. Every
string has a byte cap: ids at `WireLimits.max_id_bytes`, a sample's `text` at
`WireLimits.max_text_bytes`, a `reward_failure` at 48 characters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from rollflash.broker.wire.sample_ranges import MAX_VERSION as _MAX_VERSION
from rollflash.broker.wire.sample_ranges import check_abstained as _check_abstained
from rollflash.broker.wire.sample_ranges import check_count as _check_count
from rollflash.broker.wire.sample_ranges import check_ids as _check_ids
from rollflash.broker.wire.sample_ranges import check_reward_parts as _check_reward_parts
from rollflash.broker.wire.sample_ranges import check_samples as _check_samples
from rollflash.broker.wire.scalars import check_schema, check_text, int_field, mac_field, text_field
from rollflash.broker.wire.turns import TURN_FIELDS as _TURN_FIELDS
from rollflash.broker.wire.turns import TURN_NAMES as _TURN_NAMES
from rollflash.broker.wire.turns import check_turns as _check_turns
from rollflash.broker.wire.wire import (
    BodyReader,
    WireError,
    WireLimits,
    array_from,
    check_name,
    known_keys,
    pack_array,
    typed,
)

SCHEMA_VERSION = 2


@dataclass
class PromptWork:
    """One unit of work on the prompts stream: sample `n` responses for `item`."""

    prompt_id: str  # stable id of the task item, e.g. "train-000123"
    group_id: str  # unique per issue of a prompt; the trajectory id derives from it
    n: int  # samples to draw (the group size)
    issued_version: int  # learner version when the prompt was admitted
    item: dict[str, Any]  # the task item (prompt text, answer, ...) as plain msgpack types
    sample_index: int = -1  # with prompt replication: which sample of the group (-1: all n)
    retried: bool = False  # set by the reader, not on the wire: delivered before (streams.py)
    mac: str = ""  # the learner's MAC over the fields above (broker/channels/provenance.py)
    # issued again by the learner (broker/channels/inflight.py): `reissued` = 1 on the wire
    reissued: bool = False
    prompt_ids: list[int] | None = None  # not on the wire: the tokens the learner's MAC signs


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
    reward_failure: str = ""  # why the reward failed, e.g. "code_timeout" (absent if "")
    # each reward function's score, None where it failed (absent on the wire if None)
    reward_parts: dict[str, float | None] | None = None
    reward_abstained: tuple[str, ...] = ()  # the reward functions that returned None (or absent)


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
    mac: str = ""  # the prompt entry's, which the learner checks (broker/channels/provenance.py)

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
            mac=work.mac,
        )


def encode_prompt(w: PromptWork) -> dict[str, Any]:
    data = msgpack.packb({"item": w.item}, use_bin_type=True)
    return {
        "schema": SCHEMA_VERSION,
        "prompt_id": w.prompt_id,
        "group_id": w.group_id,
        "n": w.n,
        "issued_version": w.issued_version,
        "sample_index": w.sample_index,
        "mac": w.mac,
        "data": data,
    }


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
    if s.reward_failure:
        out["reward_failure"] = s.reward_failure
    if s.reward_parts:
        out["reward_parts"] = s.reward_parts
    if s.reward_abstained:
        out["reward_abstained"] = list(s.reward_abstained)
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
        "mac": t.mac,
        "data": msgpack.packb(body, use_bin_type=True),
    }


_PROMPT_BODY = frozenset({"item"})


def decode_prompt(fields: dict[bytes, bytes], max_bytes: int) -> PromptWork:
    """Decode and validate one prompt entry; raises WireError with the reason."""
    return _decoded("prompt", lambda: _decode_prompt(fields, WireLimits(max_bytes=max_bytes)))


def _decode_prompt(fields: dict[bytes, bytes], limits: WireLimits) -> PromptWork:
    check_schema(fields, SCHEMA_VERSION)
    body = BodyReader(fields.get(b"data"), limits)
    item = None
    for _ in body.fields("prompt", _PROMPT_BODY):
        item = body.typed("prompt.item", dict)
    body.finish()
    if item is None:
        raise WireError("prompt: item missing", "schema")
    n = int_field(fields, "n", "prompt", 1, limits.max_samples)
    return PromptWork(
        prompt_id=text_field(fields, "prompt_id", "prompt", limits),
        group_id=text_field(fields, "group_id", "prompt", limits),
        n=n,
        issued_version=int_field(fields, "issued_version", "prompt", 0, _MAX_VERSION),
        item=item,
        sample_index=int_field(fields, "sample_index", "prompt", -1, limits.max_samples * 4),
        mac=mac_field(fields, "prompt", limits),
        reissued=fields.get(b"reissued") == b"1",
    )


_TRAJECTORY_BODY = frozenset({"prompt_ids", "issued_version", "samples", "retried"})
_SAMPLE_BODY = frozenset(
    {"response_ids", "logprobs", "token_versions", "reward", "finished", "text", "env_errors"}
    | {"reward_failure", "reward_parts", "reward_abstained"}
    | {name for name, _ in _TURN_FIELDS}
)


def decode_trajectory(fields: dict[bytes, bytes], limits: WireLimits) -> Trajectory:
    """Decode and validate one trajectory entry against `limits`; raises WireError (and nothing
    else) with the reason."""
    return _decoded("trajectory", lambda: _decode_trajectory(fields, limits))


def _decoded(what: str, decode: Callable[[], Any]) -> Any:
    """Run a decoder; an exception that is not already a WireError becomes one, so a reader can
    dead-letter every entry it cannot take, whatever went wrong."""
    try:
        return decode()
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"{what}: undecodable ({e.__class__.__name__}: {e!s:.80})") from None


def _decode_trajectory(fields: dict[bytes, bytes], limits: WireLimits) -> Trajectory:
    check_schema(fields, SCHEMA_VERSION)
    body = BodyReader(fields.get(b"data"), limits)
    parts: dict[str, Any] = {"retried": False}
    for key in body.fields("trajectory", _TRAJECTORY_BODY):
        if key == "prompt_ids":
            parts[key] = body.array("prompt_ids", "<i4", 1, limits.max_tokens)
        elif key == "samples":
            raw = body.mappings("trajectory.samples", limits.max_samples)
            parts[key] = [_decode_sample(s, f"samples[{i}]", limits) for i, s in enumerate(raw)]
        elif key == "issued_version":
            parts[key] = body.typed("trajectory.issued_version", int)
        else:
            parts[key] = body.typed("trajectory.retried", bool)
    body.finish()
    missing = _TRAJECTORY_BODY - {"retried"} - parts.keys()
    if missing:
        raise WireError(f"trajectory: missing {', '.join(sorted(missing))}", "schema")
    samples, prompt_ids = parts["samples"], parts["prompt_ids"]
    if not samples:
        raise WireError("trajectory: no samples", "out_of_range")
    _check_ids(prompt_ids, "prompt_ids", limits)
    oldest = _check_samples(samples, limits)
    behavior = int_field(fields, "behavior_version", "trajectory", 0, _MAX_VERSION)
    if behavior != oldest:
        raise WireError(
            f"trajectory.behavior_version: {behavior} is not its oldest token's version {oldest}",
            "out_of_range",
        )
    if int_field(fields, "n", "trajectory", 1, limits.max_samples) != len(samples):
        raise WireError(f"trajectory.n: does not match its {len(samples)} samples", "out_of_range")
    if not 0 <= parts["issued_version"] <= _MAX_VERSION:
        raise WireError("trajectory.issued_version: out of range", "out_of_range")
    return Trajectory(
        traj_id=text_field(fields, "traj_id", "trajectory", limits),
        prompt_id=text_field(fields, "prompt_id", "trajectory", limits),
        group_id=text_field(fields, "group_id", "trajectory", limits),
        generator=text_field(fields, "generator", "trajectory", limits),
        behavior_version=behavior,
        issued_version=parts["issued_version"],
        prompt_ids=prompt_ids,
        samples=samples,
        retried=parts["retried"],
        mac=mac_field(fields, "trajectory", limits),
    )


def _decode_sample(fields: dict[Any, Any], what: str, limits: WireLimits) -> Sample:
    """One sample from its fields, decoded whole (broker/wire/wire.py `mappings`); their values'
    ranges are checked over the whole trajectory (`_check_samples`), so a bad value in one sample
    refuses the whole entry as before."""
    reward, finished, text = fields.get("reward"), fields.get("finished"), fields.get("text")
    if (  # the common case, decided in one pass; anything else takes the checked path, which
        # names the first fault in the fields' order
        fields.keys() == _SINGLE_TURN
        and (reward.__class__ is float or reward.__class__ is int)
        and math.isfinite(reward)
        and finished.__class__ is bool
        and (text.__class__ is str and len(text) <= limits.max_text_bytes // 4)
    ):
        most = limits.max_tokens
        try:
            ids = array_from(fields["response_ids"], f"{what}.response_ids", "<i4", 1, most)
            logprobs = array_from(fields["logprobs"], f"{what}.logprobs", "<f4", 1, most)
            versions = array_from(
                fields["token_versions"], f"{what}.token_versions", "<i4", 1, most
            )
        except WireError:
            pass
        else:
            if ids.shape == logprobs.shape == versions.shape:
                return Sample(ids, logprobs, versions, float(reward), finished, text)
    return _decode_sample_checked(fields, what, limits)


def _decode_sample_checked(fields: dict[Any, Any], what: str, limits: WireLimits) -> Sample:
    """`_decode_sample` by checking every field in turn: the one path for multi-turn samples and
    for refusals; tests/unit/test_wire_fast_paths.py proves the fast path gives the same."""
    parts = dict[str, Any]()
    known_keys(fields, what, _SAMPLE_BODY)
    for key, value in fields.items():
        if key in _SAMPLE_ARRAYS:
            dtype, ndim = _SAMPLE_ARRAYS[key]
            parts[key] = array_from(value, f"{what}.{key}", dtype, ndim, limits.max_tokens)
        elif key == "reward":
            parts[key] = float(typed(value, what, (float, int), ".reward"))
        elif key == "env_errors":
            parts[key] = typed(value, what, int, ".env_errors")
        elif key == "reward_failure":
            parts[key] = check_name(typed(value, f"{what}.{key}", str), f"{what}.{key}")
        elif key == "reward_parts":
            parts[key] = _check_reward_parts(value, f"{what}.{key}", limits)
        elif key == "reward_abstained":
            parts[key] = _check_abstained(value, f"{what}.{key}", limits)
        else:
            parts[key] = typed(value, what, bool if key == "finished" else str, "." + key)
    missing = _SAMPLE_REQUIRED - parts.keys()
    if missing:
        raise WireError(f"{what}: missing {', '.join(sorted(missing))}", "schema")
    ids, logprobs, versions = parts["response_ids"], parts["logprobs"], parts["token_versions"]
    if not ids.shape == logprobs.shape == versions.shape:
        raise WireError(
            f"{what}: response_ids, logprobs and token_versions differ in shape", "bad_shape"
        )
    if not math.isfinite(parts["reward"]):
        raise WireError(f"{what}.reward: not finite ({parts['reward']})", "out_of_range")
    check_text(parts["text"], f"{what}.text", limits)
    env_errors = _check_count(parts.get("env_errors", 0), f"{what}.env_errors")
    turns = {k: parts[k] for k in _TURN_NAMES if k in parts}
    return Sample(
        response_ids=ids,
        logprobs=logprobs,
        token_versions=versions,
        reward=parts["reward"],
        finished=parts["finished"],
        text=parts["text"],
        **_check_turns(turns, ids.shape[0], what),
        env_errors=env_errors,
        reward_failure=parts.get("reward_failure", ""),
        reward_parts=parts.get("reward_parts"),
        reward_abstained=parts.get("reward_abstained", ()),
    )


_SAMPLE_ARRAYS = {
    "response_ids": ("<i4", 1),
    "logprobs": ("<f4", 1),
    "token_versions": ("<i4", 1),
    **{name: (dtype, 1) for name, dtype in _TURN_FIELDS},
}
_SINGLE_TURN = {"response_ids", "logprobs", "token_versions", "reward", "finished", "text"}
_SAMPLE_REQUIRED = _SINGLE_TURN  # every sample's keys: the others of _SAMPLE_BODY are optional
