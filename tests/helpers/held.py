"""What a finished run may leave pending in the learner group, and why it is not lost.

An XREADGROUP's COUNT applies to each stream: a read for the k groups a step still needs may take
up to k from every generator. What the step does not take stays ready (unacknowledged) for the
next one, and the last step's leftovers stay pending when the run ends. A run extended from the
final checkpoint re-reads and trains them (learner/rank.py `resume_after`), so the
guarantee for each of them is: never trained, no ledger record, and not among the ids the final
checkpoint counts as consumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import redis

from rollflash.broker.connect.keys import LEARNER_GROUP
from rollflash.learner.durability.checkpoint import STATE, CheckpointStore
from tests.helpers import ledger_files as ledger


def held_at_end(r: redis.Redis, run_id: str, run_dir: Path) -> list[str]:
    """The refs (`generator/entry id`) pending in the learner group after the run; asserts that
    the learner holds each of them for a continued run (the module docstring)."""
    files = [ledger.read([p]) for p in sorted(run_dir.glob("ledger*.jsonl"))]
    records, trained = ledger.audit(files), set(ledger.trained_ids(files))
    latest = CheckpointStore(run_dir).latest()
    assert latest is not None, f"no checkpoint in {run_dir}"
    seen = {t for ids in json.loads((latest / STATE).read_text())["seen"].values() for t in ids}
    held = []
    for key in sorted(k.decode() for k in r.scan_iter(match=f"rl:{run_id}:traj:*")):
        generator = key.rsplit(":", 1)[1]
        for p in r.xpending_range(key, LEARNER_GROUP, min="-", max="+", count=10_000):
            entry_id = p["message_id"].decode()
            ref = f"{generator}/{entry_id}"
            ((_, fields),) = r.xrange(key, entry_id, entry_id)
            traj_id = fields[b"traj_id"].decode()
            assert ref not in records, (ref, records[ref])
            assert traj_id not in trained and traj_id not in seen, (ref, traj_id)
            held.append(ref)
    return held
