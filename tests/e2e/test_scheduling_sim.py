"""Rollout scheduling as real processes (learner + generators + redis-server) with the simulated
engine and learner, so the runs are quick: redundant sampling, prompt replication, interrupts,
continuous batching."""

import json
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import redis

from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import WeightStore

N = 4


def _run(tmp_path, redis_url, run_id, *sets, steps=3, generators=2):
    run_dir = tmp_path / "run"
    args = [
        "--set",
        f"run.run_id={run_id}",
        "--set",
        f"run.run_dir={run_dir}",
        "--set",
        "rollout.engine=sim",
        "--set",
        f"rollout.num_return_sequences={N}",
        "--set",
        "rollout.max_new_tokens=64",
        "--set",
        "sim.per_token_s=0.002",
        "--set",
        "sim.length_median=16",
        "--set",
        "sim.learner_step_s=0.2",
        "--set",
        "trainer.rollout_batch_size=4",
        "--set",
        f"trainer.total_steps={steps}",
        "--set",
        "trainer.wait_timeout_s=60",
        "--set",
        "eval.size=1",
        "--set",
        "run.torch_threads=1",
        "--set",  # the tests read every trajectory back: none is trimmed during a run
        "redis.keep_acknowledged_s=3600",
    ]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--redis-url",
            redis_url,
            "--generators",
            str(generators),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    r = redis.Redis.from_url(redis_url)
    entries = [e for k in sorted(r.scan_iter(match=f"rl:{run_id}:traj:*")) for e in r.xrange(k)]
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    # the steps' rows (trained), with the dropped entries of the step's collection beside them
    ledger = [row for row in rows if row.get("event") is None]
    for row in rows:
        if row.get("event") == "acked":
            for key in ("late", "stale", "duplicate", "filtered"):
                ledger[0].setdefault(key, []).extend(row.get(key, []))
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
    entries, ledger = _run(
        tmp_path,
        redis_url,
        run_id,
        "rollout.replicate_prompts=true",
        "rollout.redundant_samples=1",
        "rollout.prompts_per_pull=4",
    )
    per_group: dict[str, set[str]] = {}
    for _, fields in entries:
        assert len(_samples(fields)) == 1  # one sample per entry
        per_group.setdefault(fields[b"group_id"].decode(), set()).add(fields[b"traj_id"].decode())
    trained = [g for row in ledger for g in row["trained"]]
    assert len(trained) == len(set(trained)) == 3 * 4
    for g in trained:
        assert len(per_group[g]) >= N  # a group is trained only once n samples arrived
    late = [t for row in ledger for t in row.get("late", [])]
    assert all(t.split("/")[0] in per_group for t in late)


@pytest.mark.parametrize("mode", ["pulls", "continuous"])
def test_interrupted_samples_record_the_version_of_every_token(tmp_path, redis_url, run_id, mode):
    continuous = ["rollout.inflight_samples=8"] if mode == "continuous" else []
    entries, ledger = _run(
        tmp_path,
        redis_url,
        run_id,
        "rollout.interrupt=true",
        "sim.length_median=200",
        "rollout.max_new_tokens=400",
        "sim.learner_step_s=0.05",
        "trainer.async_ratio=2",
        *continuous,
        steps=6,
    )
    mixed = 0
    for _, fields in entries:
        for s in _samples(fields):
            versions = np.frombuffer(s["token_versions"]["data"], dtype="<i4")
            assert np.all(np.diff(versions) >= 0)  # versions only move forward within a sample
            mixed += len(set(versions.tolist())) > 1
            # the group's behaviour version is its oldest token
            assert int(fields[b"behavior_version"]) <= versions.min()
    assert mixed > 0, "no sample saw a weight update mid-generation"


def _trained_entries(entries, ledger):
    trained = {g for row in ledger for g in row["trained"]}
    return [f for _, f in entries if f[b"group_id"].decode() in trained]


def test_continuous_batching_streams_complete_groups_and_trains_each_once(
    tmp_path, redis_url, run_id
):
    # 3 redundant samples of median length 2: several of a group finish in the same decode step
    entries, ledger = _run(
        tmp_path,
        redis_url,
        run_id,
        "rollout.inflight_samples=14",
        "rollout.redundant_samples=3",
        "sim.length_median=2",
        "trainer.async_ratio=1",
        steps=4,
    )
    trained = [g for row in ledger for g in row["trained"]]
    assert len(trained) == len(set(trained)) == 4 * 4
    for _, fields in entries:  # 7 started per group, the first 4 to finish kept
        assert int(fields[b"n"]) == N and len(_samples(fields)) == N
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.xpending(f"rl:{run_id}:prompts", "gen")["pending"] == 0  # every claim answered


@pytest.mark.parametrize("background", ["false", "process"])
def test_continuous_batching_at_ratio_0_is_on_policy(tmp_path, redis_url, run_id, background):
    """A prompt issued for version v waits, claimed, until v is loaded (the running samples drain
    first), so every token the learner trains on came from the version it trains; the same with
    the versions written in the step (`trainer.background_publish: false`) and by the publishing
    process while the next step runs, which also hold the weights of their own step."""
    entries, ledger = _run(
        tmp_path,
        redis_url,
        run_id,
        "rollout.inflight_samples=8",
        "trainer.async_ratio=0",
        f"trainer.background_publish={background}",
        steps=4,
    )
    trained = _trained_entries(entries, ledger)
    assert len(trained) == 4 * 4
    by_version = {}
    for fields in trained:
        issued = msgpack.unpackb(fields[b"data"])["issued_version"]
        by_version[issued] = by_version.get(issued, 0) + 1
        for s in _samples(fields):
            versions = np.frombuffer(s["token_versions"]["data"], dtype="<i4")
            assert set(versions.tolist()) == {issued}
    assert by_version == {0: 4, 1: 4, 2: 4, 3: 4}  # step s trained the 4 prompts issued for it
    store = WeightStore(tmp_path / "run")
    # the last trainer.keep_versions = 3, and an older one while a generator's heartbeat (sent
    # every second) still names it as loaded: retention spares what a generator may be using
    kept = store.versions()
    assert kept[-3:] == [2, 3, 4] and set(kept) <= {1, 2, 3, 4} and store.latest() == 4
    for v in kept:  # the simulated policy adds 1 to its weight per update: version v holds v
        weights = verified_tensors(store, v)
        assert weights["weight"].tolist() == [float(v)] * 4


@pytest.mark.parametrize("overdue_steps", [0, 4])
def test_continuous_batching_bounds_the_age_of_long_groups(
    tmp_path, redis_url, run_id, overdue_steps
):
    """Long samples, a fast learner, a = 1, interrupt. With `trainer.overdue_steps: 0` a group
    that started more than one version before the weights a generator just loaded is started
    again rather than finished, and nothing older than one step is trained. With 4 (the
    default), a group still being generated when it turns one step old is finished and trained,
    counted as overdue, up to 1 + 4 steps old; only older ones are started again."""
    # versions advance every 4 short groups, while a long one (up to 1000 tokens, 2 s) spans
    # several of them; with a 400-token cap a run without any restart was seen
    entries, ledger = _run(
        tmp_path,
        redis_url,
        run_id,
        "rollout.inflight_samples=8",
        "rollout.interrupt=true",
        "sim.length_median=150",
        "sim.length_sigma=1.2",
        "rollout.max_new_tokens=1000",
        "sim.learner_step_s=0.05",
        "trainer.async_ratio=1",
        f"trainer.overdue_steps={overdue_steps}",
        steps=8,
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    restarted = sum(int(r.hget(k, "restarted") or 0) for k in r.keys(f"rl:{run_id}:gen:*"))
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "status",
            "--redis-url",
            redis_url,
            "--set",
            f"run.run_id={run_id}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "mean_batch=" in text and "restarted=" in text, text
    trained = _trained_entries(entries, ledger)
    assert len(trained) == 8 * 4
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    oldest = max(m["async/staleness_max"] for m in metrics)
    overdue = sum(m["async/overdue"] for m in metrics)
    if overdue_steps == 0:
        assert restarted > 0 and oldest <= 1 and overdue == 0
    else:
        assert 1 < oldest <= 1 + overdue_steps and overdue > 0


def test_a_run_over_http_gives_every_generator_its_versions_through_its_own_store(
    tmp_path, redis_url, run_id
):
    """`weights.transport: http` under `rollctl run` (which makes the run's weights token): the
    generators fetch each version from the learner's publishing process or from each other, into
    stores of their own under run_dir/local, and load them."""
    entries, ledger = _run(
        tmp_path, redis_url, run_id, "weights.transport=http", "rollout.interrupt=true"
    )
    assert sum(len(row["trained"]) for row in ledger) == 3 * 4  # 3 steps x 4 groups
    run_dir = tmp_path / "run"
    loaded = 0
    for i in range(2):
        log = (run_dir / "logs" / f"gen-{i}.log").read_text()
        assert "relaying weight versions at http://127.0.0.1:" in log
        # every version a generator loads was fetched over HTTP into its own store; how many
        # each loads depends on when it joined (one that starts as the run ends loads none)
        loads = [line for line in log.splitlines() if "loaded weights v" in line]
        assert all("B from http://127.0.0.1:" in line for line in loads), loads
        if loads:
            own = WeightStore(run_dir / "local" / f"gen-{i}")
            assert own.versions() and own.root != WeightStore(run_dir).root
        loaded += len(loads)
    assert loaded >= 1  # step 3 trains samples of v1 or later (async_ratio 1): someone loaded it
