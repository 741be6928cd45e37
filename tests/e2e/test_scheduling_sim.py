"""Rollout scheduling as real processes (learner + generators + redis-server) with the simulated
engine and learner, so the runs are quick: redundant sampling, prompt replication, interrupts."""

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

N = 4


def _run(tmp_path, redis_url, run_id, *sets, steps=3, generators=2):
    run_dir = tmp_path / "run"
    args = ["--set", f"run.run_id={run_id}", "--set", f"run.run_dir={run_dir}",
            "--set", "rollout.engine=sim", "--set", f"rollout.num_return_sequences={N}",
            "--set", "rollout.max_new_tokens=64", "--set", "sim.per_token_s=0.002",
            "--set", "sim.length_median=16", "--set", "sim.learner_step_s=0.2",
            "--set", "trainer.rollout_batch_size=4", "--set", f"trainer.total_steps={steps}",
            "--set", "trainer.wait_timeout_s=60", "--set", "task.eval_size=1",
            "--set", "run.torch_threads=1"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([sys.executable, "-m", "rollctl.cli", "run", "--redis-url", redis_url,
                           "--generators", str(generators), *args],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    r = redis.Redis.from_url(redis_url)
    entries = r.xrange(f"rl:{run_id}:trajectories")
    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return entries, ledger


def _samples(fields):
    return msgpack.unpackb(fields[b"data"])["samples"]


def test_redundant_sampling_keeps_exactly_n_per_group(tmp_path, redis_url, run_id):
    entries, ledger = _run(tmp_path, redis_url, run_id, "rollout.redundant_samples=3")
    assert entries
    for _, fields in entries:
        assert int(fields[b"n"]) == N and len(_samples(fields)) == N
    assert sum(len(row["trained"]) for row in ledger) == 3 * 4


def test_replicated_prompts_are_assembled_into_complete_groups(tmp_path, redis_url, run_id):
    entries, ledger = _run(tmp_path, redis_url, run_id, "rollout.replicate_prompts=true",
                           "rollout.redundant_samples=1", "rollout.prompts_per_pull=4")
    per_group: dict[str, set[str]] = {}
    for _, fields in entries:
        assert len(_samples(fields)) == 1  # one sample per entry
        per_group.setdefault(fields[b"group_id"].decode(), set()).add(fields[b"traj_id"].decode())
    trained = [g for row in ledger for g in row["trained"]]
    assert len(trained) == len(set(trained)) == 3 * 4
    for g in trained:
        assert len(per_group[g]) >= N  # a group is trained only once n samples arrived
    late = [t for row in ledger for t in row["late"]]
    assert all(t.split("/")[0] in per_group for t in late)


def test_interrupted_samples_record_the_version_of_every_token(tmp_path, redis_url, run_id):
    entries, ledger = _run(tmp_path, redis_url, run_id, "rollout.interrupt=true",
                           "sim.length_median=200", "rollout.max_new_tokens=400",
                           "sim.learner_step_s=0.05", "trainer.async_ratio=2", steps=6)
    mixed = 0
    for _, fields in entries:
        for s in _samples(fields):
            versions = np.frombuffer(s["token_versions"]["data"], dtype="<i4")
            assert np.all(np.diff(versions) >= 0)  # versions only move forward within a sample
            mixed += len(set(versions.tolist())) > 1
            # the group's behaviour version is its oldest token
            assert int(fields[b"behavior_version"]) <= versions.min()
    assert mixed > 0, "no sample saw a weight update mid-generation"
