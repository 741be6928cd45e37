"""Least privilege on the wire: each generator's user can do its job and nothing else, the
learner's user works on its run only, and neither can run anything server-wide."""

import subprocess
import sys

import numpy as np
import pytest
import redis

from rollflash.broker.config.config import load_config
from rollflash.broker.connect import functions
from rollflash.broker.connect.acl import generator_acl, generator_user, learner_acl, learner_user
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory


@pytest.fixture
def users(redis_url, run_id):
    """URLs of the learner's user and of gen-0's and gen-1's, created as `rollctl acl` does."""
    admin = redis.Redis.from_url(redis_url)
    names = [learner_user(run_id)] + [generator_user(run_id, f"gen-{i}") for i in range(2)]
    admin.execute_command("ACL", "SETUSER", names[0], *learner_acl(run_id, "lpw"))
    for i in range(2):
        admin.execute_command(
            "ACL", "SETUSER", names[1 + i], *generator_acl(run_id, f"gen-{i}", "gpw")
        )
    sock = redis_url.removeprefix("unix://")
    yield [f"unix://{names[0]}:lpw@{sock}"] + [f"unix://{n}:gpw@{sock}" for n in names[1:]]
    admin.execute_command("ACL", "DELUSER", *names)


def _run(learner_url, gen_url, run_id):
    learner = LearnerBroker(connect(learner_url, 5), run_id, 100_000)
    learner.take_lease()
    learner.ensure_groups()
    learner.register_run(load_config(None).fingerprint())
    learner.track_trajectory_writes()
    learner.add_prompts(
        [PromptWork("p0", "g0", 1, 0, {"id": "p0", "prompt": "1+1=", "answer": "2"})]
    )
    learner.announce_weights(0, "/w/v0", "abc", "tcp://127.0.0.1:1")
    gen = GeneratorBroker(connect(gen_url, 5), run_id, "gen-0", 100_000)
    gen.ask_to_join({"state": "up"}, ttl_s=30)
    learner.maintain_now()  # admits gen-0 (under the learner's user: no SCAN needed)
    gen.join_run(load_config(None).fingerprint(), timeout_s=5)
    return learner, gen


def test_generator_user_can_work_but_not_reach_further(users, run_id):
    learner_url, gen_url, other_url = users
    learner, gen = _run(learner_url, gen_url, run_id)
    ((entry_id, work),) = gen.claim_prompts(1, block_ms=100)
    assert gen.weights()["version"] == "0"
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    t = Trajectory("g0", "p0", "g0", "gen-0", 0, 0, np.array([1], np.int32), [s], mac=work.mac)
    gen.add_trajectory(t, entry_id)
    learner.maintain_now()  # checks and trims gen-0's stream under the learner's user
    good, bad = learner.read_trajectories("rank0", 10, 100, (10, 1, 0))
    assert [t.traj_id for _, t in good] == ["g0"] and bad == []
    learner.ack_trajectories([r for r, _ in good], finished=["g0"])
    learner.maintain_now()

    # what a GeneratorBroker has no method for, its user may not do either
    c, k, other = gen.io.client, RunKeys(run_id), RunKeys(f"other-{run_id}")
    forbidden = [
        # issuing prompts is the learner's job: its functions check the lease, which gen-0
        # may not read
        lambda: functions.fcall(c, "issue", [k.lease, k.prompts, k.inflight, k.run], ["x", ""]),
        lambda: c.xadd(k.prompts, {"x": 1}),
        lambda: c.xrange(k.trajectories("gen-0")),  # its own stream is write-only
        lambda: c.xadd(k.trajectories("gen-1"), {"x": 1}),  # another generator's stream
        lambda: c.xadd(k.dlq, {"x": 1}),  # the learner's dead letters
        lambda: c.hincrby(k.dlq_reasons, "corrupt", 10**6),  # the learner's dead-letter counts
        lambda: c.hset(k.gen("gen-1"), "groups", 10**6),  # another generator's heartbeat
        lambda: c.get(k.mac_key),  # the MAC key: it could sign prompts never issued
        lambda: c.hset(k.weights, "version", 99),  # cannot announce weights
        lambda: c.hset(k.generators, "gen-0", "active"),  # nor lift its own quarantine
        lambda: c.delete(k.prompts),
        lambda: c.hset(k.run, "state", "done"),
        lambda: c.hgetall(other.weights),  # another run's keys
        lambda: c.eval("return 1", 0),  # no Lua of its own
        lambda: c.function_flush(),
        lambda: c.function_load(functions.CODE, replace=True),
        lambda: c.flushall(),
        lambda: c.config_get("*"),
        lambda: c.scan(),
    ]
    for attempt in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    learner.release()


def test_learner_user_is_confined_to_its_run(users, run_id):
    r = redis.Redis.from_url(users[0])
    r.hset(f"rl:{run_id}:run", "x", 1)
    for attempt in (
        lambda: r.get("unrelated"),
        lambda: r.get(f"rl:other-{run_id}:run"),
        lambda: r.scan(),  # SCAN lists every run's key names
        lambda: r.keys("*"),
        lambda: r.execute_command("SELECT", "1"),
        lambda: r.function_flush(),
        lambda: r.function_delete(functions.LIBRARY),
        lambda: r.script_flush(),
        lambda: r.eval("return 1", 0),
        lambda: r.flushall(),
        lambda: r.flushdb(),
        lambda: r.info(),
        lambda: r.dbsize(),
        lambda: r.config_set("maxmemory", "1"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_rollctl_acl_apply_creates_working_users(redis_url, run_id):
    def acl(*extra):
        return subprocess.run(
            [sys.executable, "-m", "rollflash.rollctl.cli", "acl", "--redis-url", redis_url,
             "--set", f"run.run_id={run_id}", "--apply", *extra],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip

    gen_out = acl("--generator", "gen-7", "--password", "s3cret")
    assert f"ACL SETUSER rl-{run_id}-gen-gen-7 on >s3cret" in gen_out
    assert f"#   HSET PEXPIRE on rl:{run_id}:gen:gen-7" in gen_out  # its powers, in words
    learner_out = acl("--password", "l3arner")
    assert f"ACL SETUSER rl-{run_id}-learner on >l3arner" in learner_out
    sock = redis_url.removeprefix("unix://")
    gen = redis.Redis.from_url(f"unix://rl-{run_id}-gen-gen-7:s3cret@{sock}")
    assert gen.hset(f"rl:{run_id}:gen:gen-7", "state", "up") == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        gen.xrange(f"rl:{run_id}:traj:gen-7")
    learner = redis.Redis.from_url(f"unix://rl-{run_id}-learner:l3arner@{sock}")
    assert learner.hgetall(f"rl:{run_id}:gen:gen-7") == {b"state": b"up"}
    redis.Redis.from_url(redis_url).execute_command(
        "ACL", "DELUSER", f"rl-{run_id}-gen-gen-7", f"rl-{run_id}-learner"
    )


def test_a_run_id_with_a_wildcard_is_refused_before_anything_is_made(redis_url, tmp_path):
    """`exp*` in an ACL key pattern would give run exp's users the keys of every run named
    exp...: it is refused at config load, by every command, with one line naming the key."""
    for command in (["acl", "--redis-url", redis_url], ["start-learner", "--redis-url", redis_url]):
        p = subprocess.run(
            [sys.executable, "-m", "rollflash.rollctl.cli", *command, "--set", "run.run_id=exp*",
             "--set", f"run.run_dir={tmp_path}/run"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip() == (
            "rollctl: error: run.run_id: 'exp*' is not 1 to 64 of A-Z a-z 0-9 _ . -"
        )
    assert not (tmp_path / "run").exists()
    assert redis.Redis.from_url(redis_url).keys("rl:exp*") == []
