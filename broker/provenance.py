"""Provenance: the learner trains only groups it issued, as it issued them.

Every prompt entry carries `mac`, an HMAC-SHA256 (128 bits, hex) over its group id, prompt id,
issued version, sample count and sample index, keyed by `rl:{run}:mac_key`, which only the
learner's ACL user can read (broker/acl.py). A generator copies the MAC into its trajectory; the
learner recomputes it from the trajectory's own fields (`check`), so a group it never issued, or
one whose issued version, prompt or size was changed, is refused (`not_issued`) without any
record of what was issued: the check costs no memory and survives restarts and several ranks.

`check` also refuses, as a generator's credentials could forge them:
- an issued, behaviour or token version newer than the learner's own (`future_version`): no
  generator can have sampled with weights that were not published;
- an entry whose `generator` names another generator than the stream it came from
  (`wrong_generator`);
- a whole-group entry without exactly the group's samples, or a replicated sample with more
  than one (`out_of_range`).
The first three codes quarantine the generator (broker/roster.py): an honest generator never
produces them.
"""

from __future__ import annotations

import hashlib
import hmac

from rollflash.broker.schema import PromptWork, Trajectory
from rollflash.broker.wire import WireError

FORGED = frozenset({"not_issued", "future_version", "wrong_generator"})


def mac(key: bytes, group_id: str, prompt_id: str, issued: int, n: int, sample_index: int) -> str:
    message = f"{group_id}\n{prompt_id}\n{issued}\n{n}\n{sample_index}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


def sign(key: bytes, w: PromptWork) -> PromptWork:
    """`w` with its MAC (prompt issue, learner/admission.py through the broker)."""
    w.mac = mac(key, w.group_id, w.prompt_id, w.issued_version, w.n, w.sample_index)
    return w


def sample_index(t: Trajectory) -> int:
    """-1 for a whole group (traj_id = group id), k for replicated sample k (`{group}/{k}`)."""
    if t.traj_id == t.group_id:
        return -1
    head, _, k = t.traj_id.rpartition("/")
    if head != t.group_id or not k.isdigit():
        raise WireError(f"trajectory {t.traj_id[:80]}: traj_id is not of group {t.group_id[:80]}")
    return int(k)


def check(key: bytes, t: Trajectory, generator: str, group_size: int, max_version: int) -> None:
    """Raise `WireError` (codes in the module docstring) unless `t`, read from `generator`'s
    stream, answers a prompt the learner issued, with versions it has published."""
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
    expected = mac(key, t.group_id, t.prompt_id, t.issued_version, n, k)
    if not hmac.compare_digest(expected, t.mac):
        raise WireError(
            f"trajectory {t.traj_id[:80]}: no prompt the learner issued has these fields "
            "(its MAC does not match)",
            "not_issued",
        )
    tokens = (int(s.token_versions.max()) for s in t.samples if s.token_versions.size)
    newest = max(t.issued_version, t.behavior_version, *tokens)
    if newest > max_version:
        raise WireError(
            f"trajectory {t.traj_id[:80]}: version {newest} is newer than the learner's "
            f"{max_version}",
            "future_version",
        )
