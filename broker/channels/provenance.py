"""Provenance: the learner trains only groups it issued, as it issued them.

Every prompt entry carries `mac`: two HMAC-SHA256 tags of 128 bits each (64 hex digits in all),
keyed by `rl:{run}:mac_key`, which only the learner's ACL user can read (broker/connect/acl.py):
- the first over its group id, prompt id, issued version, sample count and sample index;
- the second over the same fields and the sha256 of the prompt's token ids as the learner
  derived them when it issued the prompt (`PromptWork.prompt_ids`: learner/intake/admission.py with
  envs/chat.py `prompt_encoder`, the encoding every engine uses), or over `UNCHECKED` where the
  learner cannot derive them (an agent program composes its own prompts).
A generator copies the MAC into its trajectory; the learner recomputes both tags from the
trajectory's own fields and its `prompt_ids` (`check`), so a group it never issued, or one whose
issued version, prompt or size was changed, is refused (`not_issued`), and one whose prompt
tokens are not those the learner issued is refused (`wrong_prompt`), without any record of what
was issued: the check costs two HMACs and a sha256 of the prompt, no memory and no Redis round
trip, survives restarts and works on every rank. Every entry of a replicated prompt carries the
same prompt tokens, each under its own tags.

`check` also refuses, as a generator's credentials could forge them:
- an issued, behaviour or token version newer than the learner's own (`future_version`): no
  generator can have sampled with weights that were not published;
- an entry whose `generator` names another generator than the stream it came from
  (`wrong_generator`);
- a whole-group entry without exactly the group's samples, or a replicated sample with more
  than one (`out_of_range`).
The first four codes quarantine the generator (broker/channels/roster.py): an honest generator never
produces them (`wrong_prompt` from an honest one means its tokenizer, or its `model.path`
directory, differs from the learner's).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

from rollflash.broker.wire.schema import PromptWork, Trajectory
from rollflash.broker.wire.wire import WireError

FORGED = frozenset({"not_issued", "wrong_prompt", "future_version", "wrong_generator"})
UNCHECKED = "unchecked"  # signed instead of a digest where the learner cannot derive the tokens
TAG = 32  # hex digits of one tag (128 bits)


def token_digest(ids: Sequence[int] | np.ndarray) -> str:
    """sha256 of token ids as little-endian int32 (their wire encoding), in hex."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def _fields(group_id: str, prompt_id: str, issued: int, n: int, sample_index: int) -> str:
    return f"{group_id}\n{prompt_id}\n{issued}\n{n}\n{sample_index}"


def _tag(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()[:TAG].encode()


def mac(
    key: bytes,
    group_id: str,
    prompt_id: str,
    issued: int,
    n: int,
    sample_index: int,
    prompt_ids: Sequence[int] | None = None,
) -> str:
    """The MAC of a prompt entry (module docstring); `prompt_ids` None: not checked."""
    fields = _fields(group_id, prompt_id, issued, n, sample_index)
    prompt = UNCHECKED if prompt_ids is None else token_digest(prompt_ids)
    return (_tag(key, fields) + _tag(key, f"{fields}\n{prompt}")).decode()


def sign(key: bytes, w: PromptWork) -> PromptWork:
    """`w` with its MAC (prompt issue, learner/intake/admission.py through the broker)."""
    w.mac = mac(key, w.group_id, w.prompt_id, w.issued_version, w.n, w.sample_index, w.prompt_ids)
    return w


def sample_index(t: Trajectory) -> int:
    """-1 for a whole group (traj_id = group id), k for replicated sample k (`{group}/{k}`)."""
    if t.traj_id == t.group_id:
        return -1
    head, _, k = t.traj_id.rpartition("/")
    if head != t.group_id or not k.isdigit():
        raise WireError(f"trajectory {t.traj_id[:80]}: traj_id is not of group {t.group_id[:80]}")
    return int(k)


def _signed(key: bytes, t: Trajectory, fields: str) -> None:
    """Both tags of `t.mac` against its fields and its prompt tokens (module docstring)."""
    got = t.mac.encode()  # bytes: compare_digest refuses str that is not ASCII
    if not hmac.compare_digest(_tag(key, fields), got[:TAG]):
        raise WireError(
            f"trajectory {t.traj_id[:80]}: no prompt the learner issued has these fields "
            "(its MAC does not match)",
            "not_issued",
        )
    tag = got[TAG:]
    digest = token_digest(t.prompt_ids)
    if not hmac.compare_digest(_tag(key, f"{fields}\n{digest}"), tag) and not hmac.compare_digest(
        _tag(key, f"{fields}\n{UNCHECKED}"), tag
    ):
        raise WireError(
            f"trajectory {t.traj_id[:80]}: its {t.prompt_ids.size} prompt tokens are not those "
            "of the prompt the learner issued (a forgery, or a generator whose tokenizer differs "
            "from the learner's)",
            "wrong_prompt",
        )


def check(key: bytes, t: Trajectory, generator: str, group_size: int, max_version: int) -> None:
    """Raise `WireError` (codes in the module docstring) unless `t`, read from `generator`'s
    stream, answers a prompt the learner issued, with its prompt tokens and with versions it
    has published."""
    if t.generator != generator:
        raise WireError(
            f"trajectory {t.traj_id[:80]}: names generator {t.generator[:64]!r} but came from "
            f"{generator!r}'s stream",
            "wrong_generator",
        )
    k = sample_index(t)
    n = group_size if k < 0 else 1
    if len(t.samples) != n:
        raise WireError(
            f"trajectory {t.traj_id[:80]}: {len(t.samples)} samples, its prompt asked for {n}",
            "out_of_range",
        )
    _signed(key, t, _fields(t.group_id, t.prompt_id, t.issued_version, n, k))
    tokens = (int(s.token_versions.max()) for s in t.samples if s.token_versions.size)
    newest = max(t.issued_version, t.behavior_version, *tokens)
    if newest > max_version:
        raise WireError(
            f"trajectory {t.traj_id[:80]}: version {newest} is newer than the learner's "
            f"{max_version}",
            "future_version",
        )
