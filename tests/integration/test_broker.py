"""Broker round trips against a real redis-server (started by tests/conftest.py)."""

import re
import threading
import time

import numpy as np
import pytest
import redis

from rollflash.broker.channels.registry import RunRegistry
from rollflash.broker.config.config import load_config
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from rollflash.broker.connect.keys import GEN_GROUP, LEARNER_GROUP, RunKeys
from rollflash.broker.connect.redis_io import RunMismatch, RunRedis
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from tests.faults.harness import wait_until
from tests.helpers.brokers import admit, generator


def _work(i: int, version: int = 0) -> PromptWork:
    return PromptWork(
        prompt_id=f"train-{i}",
        group_id=f"g{i:09d}",
        n=2,
        issued_version=version,
        item={"id": f"train-{i}", "prompt": f"{i}+1=", "answer": str(i + 1)},
    )


def _traj(work: PromptWork, version: int = 0) -> Trajectory:
    s = Sample(
        response_ids=np.array([5, 2], np.int32),
        logprobs=np.array([-0.1, -0.2], np.float32),
        token_versions=np.array([version, version], np.int32),
        reward=1.0,
        finished=True,
        text="x",
    )
    return Trajectory(
        traj_id=work.group_id,
        prompt_id=work.prompt_id,
        group_id=work.group_id,
        generator="gen-0",
        behavior_version=version,
        issued_version=work.issued_version,
        prompt_ids=np.array([1, 5], np.int32),
        samples=[s, s],
        mac=work.mac,
    )


@pytest.fixture
def raw(redis_url, run_id):
    """A plain client and the run's key names, to look at what the brokers wrote."""
    return redis.Redis.from_url(redis_url), RunKeys(run_id)


CHECK = (10, 2, 0)  # vocab 10, groups of 2, learner at version 0


def test_prompt_to_trajectory_round_trip(learner_broker, generator_broker, raw, redis_url, run_id):
    r, keys = raw
    other = generator(redis_url, run_id, "gen-1")
    admit(learner_broker, other)
    learner_broker.add_prompts([_work(i) for i in range(3)])
    claimed = generator_broker.claim_prompts(count=2, block_ms=100)
    assert [w.prompt_id for _, w in claimed] == ["train-0", "train-1"]
    # another consumer of the group gets the rest, never the same entries
    rest = other.claim_prompts(count=5, block_ms=100)
    assert [w.prompt_id for _, w in rest] == ["train-2"]
    for entry_id, work in claimed:
        generator_broker.add_trajectory(_traj(work), prompt_entry_id=entry_id)
    # trajectory XADD and prompt XACK happen together: gen-0 has nothing pending now
    assert r.xpending(keys.prompts, GEN_GROUP)["pending"] == 1  # gen-1's
    good, bad = learner_broker.read_trajectories("rank0", 10, 100, CHECK)
    assert bad == [] and [t.traj_id for _, t in good] == ["g000000000", "g000000001"]
    stream = keys.trajectories("gen-0")
    assert r.xpending(stream, LEARNER_GROUP)["pending"] == 2
    learner_broker.ack_trajectories([e for e, _ in good], finished=[t.traj_id for _, t in good])
    assert r.xpending(stream, LEARNER_GROUP)["pending"] == 0
    assert sorted(r.hkeys(keys.inflight)) == [b"g000000002"]  # the one still being answered
    # the scalar fields are readable as they are, as `redis-cli XRANGE` shows them
    _, fields = r.xrange(stream, count=1)[0]
    assert fields[b"traj_id"] == b"g000000000" and fields[b"reward_mean"] == b"1.0000"
    assert fields[b"behavior_version"] == b"0" and fields[b"schema"] == b"2"
    assert len(fields[b"mac"]) == 64 and fields[b"generator"] == b"gen-0"  # two 128-bit tags


def test_unacked_prompts_are_redelivered_to_the_same_consumer(learner_broker, generator_broker):
    learner_broker.add_prompts([_work(0)])
    first = generator_broker.claim_prompts(count=1, block_ms=100)
    again = generator_broker.claim_prompts(count=1, block_ms=100, own_pending=True)
    assert [e for e, _ in again] == [e for e, _ in first]
    assert [w.retried for _, w in first + again] == [False, True]  # delivered before: retried


def test_poison_trajectory_goes_to_the_dead_letter_stream(learner_broker, generator_broker, raw):
    r, keys = raw
    learner_broker.add_prompts([_work(0)])
    ((entry_id, work),) = generator_broker.claim_prompts(count=1, block_ms=100)
    good_id = generator_broker.add_trajectory(_traj(work), prompt_entry_id=entry_id)
    stream = keys.trajectories("gen-0")
    bad_id = r.xadd(stream, {"schema": 2, "traj_id": "x", "data": b"\xc1"}).decode()
    good, bad = learner_broker.read_trajectories("rank0", 10, 100, CHECK)
    assert [e for e, _ in good] == [f"gen-0/{good_id}"]
    assert [b.ref for b in bad] == [f"gen-0/{bad_id}"] and "corrupt msgpack" in bad[0].reason
    learner_broker.dead_letter(bad)  # the collector records it in its ledger first
    ((_, dlq_fields),) = r.xrange(keys.dlq)
    assert dlq_fields[b"original_id"].decode() == bad_id
    assert dlq_fields[b"source"].decode() == stream
    assert dlq_fields[b"reason"].startswith(b"corrupt msgpack")
    assert r.hget(keys.dlq_reasons, "corrupt") == b"1"
    # the poison entry was acknowledged; only the good one is pending
    assert r.xpending(stream, LEARNER_GROUP)["pending"] == 1
    # a malformed entry is no forgery: its generator stays admitted
    assert learner_broker.refused() == set()


def test_token_outside_vocabulary_is_dead_lettered(learner_broker, generator_broker):
    learner_broker.add_prompts([_work(0)])
    ((entry_id, work),) = generator_broker.claim_prompts(count=1, block_ms=100)
    generator_broker.add_trajectory(_traj(work), prompt_entry_id=entry_id)
    good, bad = learner_broker.read_trajectories("rank0", 10, 100, (4, 2, 0))
    assert good == [] and "outside the vocabulary" in bad[0].reason


def test_poison_prompt_is_dead_lettered_by_the_generator(generator_broker, raw):
    r, keys = raw
    bad_id = r.xadd(keys.prompts, {"schema": 2, "data": b"\xc1"}).decode()
    assert generator_broker.claim_prompts(count=1, block_ms=100) == []
    ((_, dlq_fields),) = r.xrange(keys.generator_dlq("gen-0"))
    assert dlq_fields[b"original_id"].decode() == bad_id
    assert r.xpending(keys.prompts, GEN_GROUP)["pending"] == 0  # acknowledged
    assert generator_broker.dead_lettered == 1
    assert r.xlen(keys.dlq) == 0  # the learner's dlq is the learner's alone


def test_a_process_with_another_config_is_refused_naming_the_keys(redis_url, run_id):
    a = LearnerBroker(connect(redis_url, 5), run_id, 1000)
    a.take_lease()
    a.register_run(load_config(None).fingerprint())
    a.register_run(load_config(None, ["trainer.total_steps=300"]).fingerprint())  # may differ
    other = load_config(None, ["rollout.temperature=0.7", "model.path=models/other"])
    b = LearnerBroker(connect(redis_url, 5), run_id, 1000)
    b.use_lease(a.lease.token)  # another rank of the same learner
    with pytest.raises(RunMismatch) as e:
        b.register_run(other.fingerprint())
    assert str(e.value).startswith(
        f"run rl:{run_id}: was started with another config; keys every process must agree on "
        'differ: model.path (the run: "models/tiny", this process: "models/other"); '
        "rollout.temperature (the run: 1.0, this process: 0.7). Use the run's config"
    )
    a.release()


def test_heartbeats_expire(learner_broker, generator_broker, redis_url, run_id):
    """A heartbeat is live until its TTL runs out, and then gone. The live half uses a TTL no
    slow machine can outlast between two calls; the expiry half is waited for, not slept: Redis
    guarantees the key is gone once its TTL has passed, whenever the test looks."""
    status = RunRegistry(RunRedis(connect(redis_url, 5), run_id))  # what `rollctl status` reads
    key = RunKeys(run_id).gen("gen-0")
    r = redis.Redis.from_url(redis_url)
    generator_broker.heartbeat({"loaded_version": 3}, ttl_s=600)
    assert 0 < r.pttl(key) <= 600_000  # the heartbeat carries its TTL
    assert status.live_generators()["gen-0"]["loaded_version"] == "3"
    assert learner_broker.loaded_versions() == {3}
    generator_broker.heartbeat({"loaded_version": 4}, ttl_s=0.2)  # each beat renews it
    assert r.pttl(key) <= 200
    wait_until(lambda: not status.live_generators(), 120, "gen-0's 0.2 s heartbeat to expire")
    assert learner_broker.loaded_versions() == set()  # nothing beats again


def test_a_generator_waits_out_the_learners_start_up_then_a_bounded_time(
    learner_broker, redis_url, run_id
):
    """Before the run's `state` is set the learner is still starting (its model, version 0, the
    first evaluation) and a joining generator waits for it, past its timeout and renewing its
    heartbeat; once the loop runs the timeout binds. Shown by events, not by the clock: the
    waiting generator renews its beat `ttl_s / 3` = 0.5 s after its first one, past its 0.2 s
    timeout, so a renewed beat (a new `heartbeat_at`) while it still waits shows it waited on."""
    early, late = generator(redis_url, run_id, "gen-0"), generator(redis_url, run_id, "gen-1")
    r, beat = redis.Redis.from_url(redis_url), RunKeys(run_id).gen("gen-0")
    early.ask_to_join({"state": "up"}, ttl_s=1.5)
    first_beat = r.hget(beat, "heartbeat_at")
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            early.wait_admitted(0.2, {"state": "up"}, ttl_s=1.5)
        except BaseException as e:  # shown by the waits below
            failed.append(e)

    waiting = threading.Thread(target=wait, daemon=True)  # a failed test leaves it waiting
    waiting.start()

    def renewed() -> bool:
        assert not failed, f"the generator stopped waiting for the learner's start-up: {failed}"
        return r.hget(beat, "heartbeat_at") not in (None, first_beat)

    wait_until(renewed, 120, "the waiting generator to renew its heartbeat")
    # admitted once the learner looks while its beat is live (a slow machine may let it lapse
    # between two renewals; it is renewed every 0.5 s)
    wait_until(learner_broker.roster.admit_joined, 120, "the learner to admit gen-0")
    waiting.join(timeout=120)
    assert not waiting.is_alive() and not failed, f"gen-0 saw no admission: {failed}"
    assert early.status() == "active"
    learner_broker.set_run_fields(state="training")
    late.ask_to_join({"state": "up"}, ttl_s=600)  # nobody admits it now
    with pytest.raises(RunMismatch, match="did not admit generator gen-1 within 0s"):
        late.wait_admitted(0.2)


def test_the_learner_sums_live_generators_reward_errors(learner_broker, redis_url, run_id):
    assert learner_broker.generator_stats() == (None, 0)  # no generator yet
    gens = [generator(redis_url, run_id, f"gen-{i}") for i in range(3)]
    admit(learner_broker, *gens)
    gens[0].heartbeat({"reward_errors": 3, "idle_frac": 0.5}, ttl_s=30)
    gens[1].heartbeat({"reward_errors": 4, "idle_frac": 0.1}, ttl_s=30)
    gens[2].heartbeat({"loaded_version": 1}, ttl_s=30)  # no count reported
    idle_frac, reward_errors = learner_broker.generator_stats()
    assert reward_errors == 3 + 4 and idle_frac == pytest.approx((0.5 + 0.1) / 2)


def test_a_redis_missing_at_start_up_is_reported_after_the_first_contacts_timeout(tmp_path):
    # the first contact retries for STARTUP_TIMEOUT_S (1 s), not for the 30 s a running process
    # waits out a lost connection. The backoff allows at most 4 attempts in 1 s (at 0, 0.2, 0.6
    # and 1.0 s: 0.2 + 0.4 + the 0.8 cut to 0.4 at the deadline), fewer if the machine is slow;
    # 30 s would allow 11 (0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 5 * 4 = 26.2, then the 5 cut to 3.8)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="cannot reach Redis at unix://.* in 1s") as e:
        connect(f"unix://{tmp_path}/nothing.sock", timeout_s=30)
    attempts = int(re.search(r"after (\d+) attempts", str(e.value))[1])
    assert 2 <= attempts <= 4, str(e.value)
    assert time.monotonic() - started >= 1.0  # retried until its timeout, counted from then


def test_after_the_first_contact_the_whole_timeout_is_waited_out(tmp_path):
    from rollflash.broker.connect.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url, timeout_s=2.5)
    server.kill()
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="cannot reach Redis at unix://.* in 2s"):
        client.ping()
    assert time.monotonic() - started >= 2.5  # retried with backoff until the timeout


def test_embedded_redis_with_a_relative_directory(tmp_path, monkeypatch):
    """`rollctl run` with run_dir "runs/demo" passes a relative path (redis-server chdirs first)."""
    from rollflash.broker.connect.redis_server import EmbeddedRedis

    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis("runs/demo/redis") as server:
        assert connect(server.url, 5).ping()
