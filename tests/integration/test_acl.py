"""Least privilege on the wire: a generator user can do its job and nothing else."""

import numpy as np
import pytest
import redis

from rollflash.broker.acl import generator_acl, learner_acl
from rollflash.broker.config import load_config
from rollflash.broker.connection import connect
from rollflash.broker.generator_side import GeneratorBroker
from rollflash.broker.keys import RunKeys
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.redis_io import RunRedis
from rollflash.broker.schema import PromptWork, Sample, Trajectory
from rollflash.broker.streams import DeadLetters, PromptQueue


@pytest.fixture
def users(redis_url, run_id):
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", f"g-{run_id}", *generator_acl(run_id, "gpw"))
    admin.execute_command("ACL", "SETUSER", f"l-{run_id}", *learner_acl(run_id, "lpw"))
    sock = redis_url.removeprefix("unix://")
    yield (f"unix://g-{run_id}:gpw@{sock}", f"unix://l-{run_id}:lpw@{sock}")
    admin.execute_command("ACL", "DELUSER", f"g-{run_id}", f"l-{run_id}")


def test_generator_user_can_work_but_not_reach_further(users, run_id):
    gen_url, learner_url = users
    learner = LearnerBroker(connect(learner_url, 5), run_id, 100_000)
    learner.ensure_groups()
    learner.register_run(load_config(None).fingerprint())
    learner.add_prompts(
        [PromptWork("p0", "g0", 1, 0, {"id": "p0", "prompt": "1+1=", "answer": "2"})]
    )
    learner.announce_weights(0, "/w/v0", "abc", "tcp://127.0.0.1:1")

    gen_client = connect(gen_url, 5)
    gen = GeneratorBroker(gen_client, run_id, 100_000)
    gen.join_run(load_config(None).fingerprint(), timeout_s=5)
    ((entry_id, work),) = gen.claim_prompts("gen-0", 1, block_ms=100)
    gen.heartbeat("gen-0", {"loaded_version": 0}, ttl_s=30)
    assert gen.weights()["version"] == "0"
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    gen.add_trajectory(
        Trajectory("g0", "p0", "g0", "gen-0", 0, 0, np.array([1], np.int32), [s]), entry_id
    )
    good, _ = learner.read_trajectories("rank0", 10, 100, vocab_size=10)
    assert [t.traj_id for _, t in good] == ["g0"]

    # what a GeneratorBroker has no method for, its user may not do either
    io = RunRedis(gen_client, run_id)
    keys = RunKeys(run_id)
    forbidden = [
        # issuing prompts is the learner's job
        lambda: PromptQueue(io, 100_000, DeadLetters(io, 100_000)).add([work]),
        lambda: gen_client.xrange(keys.trajectories),  # trajectories are write-only for generators
        lambda: gen_client.hset(keys.weights, "version", 99),  # cannot announce weights
        lambda: gen_client.delete(keys.prompts),
        lambda: gen_client.hset(keys.run, "state", "done"),
        lambda: gen_client.hgetall(RunKeys(f"other-{run_id}").weights),  # another run's keys
        lambda: gen_client.flushall(),
        lambda: gen_client.config_get("*"),
    ]
    for attempt in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_learner_user_is_confined_to_its_run(users, run_id):
    _, learner_url = users
    r = redis.Redis.from_url(learner_url)
    r.hset(f"rl:{run_id}:run", "x", 1)
    for attempt in (
        lambda: r.get("unrelated"),
        lambda: r.flushall(),
        lambda: r.config_set("maxmemory", "1"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_rollctl_acl_apply_creates_working_users(redis_url, run_id):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "acl",
            "--redis-url",
            redis_url,
            "--set",
            f"run.run_id={run_id}",
            "--generator-password",
            "s3cret",
            "--apply",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"ACL SETUSER rl-{run_id}-generator on >s3cret" in out.stdout
    sock = redis_url.removeprefix("unix://")
    gen = redis.Redis.from_url(f"unix://rl-{run_id}-generator:s3cret@{sock}")
    assert gen.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        gen.xrange(f"rl:{run_id}:trajectories")
    redis.Redis.from_url(redis_url).execute_command(
        "ACL", "DELUSER", f"rl-{run_id}-generator", f"rl-{run_id}-learner"
    )
