"""`rollctl run` with two learner ranks (torchrun underneath, gloo on CPU) as real processes:
each rank reads as its own consumer of the learner group, the ranks train disjoint groups that
together make every step's batch, everything trained is acknowledged after the final
checkpoint, and what is left pending is held for a continued run."""

import json
import subprocess
import sys

import pytest
import redis
import yaml
from safetensors.torch import load_file

from rollflash.broker.connect.keys import LEARNER_GROUP
from tests.helpers.held import held_at_end

STEPS, B, N = 4, 4, 2


@pytest.mark.parametrize("strategy", ["fsdp"])  # DDP: tests/integration/test_distributed_learner
def test_two_learner_ranks_share_every_step_and_ack_what_they_trained(
    tmp_path, tiny_model_dir, redis_url, run_id, strategy
):
    run_dir = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"run_id": run_id, "run_dir": str(run_dir), "torch_threads": 1},
                "model": {"path": str(tiny_model_dir)},
                "task": {"name": "arithmetic"},
                "eval": {"size": 8},
                "rollout": {"num_return_sequences": N, "max_new_tokens": 6, "prompts_per_pull": 1},
                "trainer": {
                    "rollout_batch_size": B,
                    "total_steps": STEPS,
                    "async_ratio": 1,
                    "wait_timeout_s": 120,
                    "num_trainer_workers": 2,
                    "checkpoint_every": 2,
                    "strategy": strategy,
                },
            }
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--config",
            str(path),
            "--generators",
            "1",
            "--redis-url",
            redis_url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_ranks"] == 2 and summary["final_version"] == STEPS
    assert 0 <= summary["heldout_acc_after"] <= 1  # rank 0 evaluated (every rank, with FSDP)
    kept = sorted((run_dir / "weights").glob("v*/model.safetensors"))
    assert kept and kept[-1].parent.name == f"v{STEPS:08d}"
    for path in kept:  # the versions kept on disk were published whole
        assert "model.embed_tokens.weight" in load_file(str(path))

    ledgers = {
        name: [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
        for name in ("ledger.jsonl", "ledger.rank1.jsonl")
    }
    per_step = {}
    for rows in ledgers.values():
        for row in rows:
            if row.get("event") is None:  # a step's trained row (learner/durability/ledger.py)
                per_step.setdefault(row["step"], []).extend(row["trained"])
    assert sorted(per_step) == list(range(1, STEPS + 1))
    assert all(len(ids) == B for ids in per_step.values())  # the ranks agree on the step size
    trained = [t for ids in per_step.values() for t in ids]
    assert len(set(trained)) == len(trained)  # disjoint across ranks and steps
    assert all(any(row.get("trained") for row in rows) for rows in ledgers.values())  # both ranks

    r = redis.Redis.from_url(redis_url)
    streams = [k.decode() for k in r.scan_iter(match=f"rl:{run_id}:traj:*")]
    consumers = {c["name"].decode() for s in streams for c in r.xinfo_consumers(s, LEARNER_GROUP)}
    assert consumers == {"rank0", "rank1"}
    # what stays pending was read but never trained: a rank's groups beyond its last quota,
    # which a resumed run would train (tests/helpers/held.py); everything trained was
    # acknowledged
    assert len(held_at_end(r, run_id, run_dir)) < B
    state = json.loads((run_dir / "checkpoints" / f"step{STEPS:08d}" / "state.json").read_text())
    assert state["step"] == STEPS and set(state["ranks"]) == {"rank0", "rank1"}
