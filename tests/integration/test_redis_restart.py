"""Redis restarts under the broker, with a real redis-server killed with SIGKILL and started again
from its directory: calls ride out the restart; with `appendfsync always` nothing acknowledged is
lost; a server that comes back empty is reported (RunLost), never silently re-created; and what a
server with `appendfsync everysec` forgets is re-added (prompts) or regenerated (trajectories), and
counted: by the generator that wrote it while it lives, and by the learner whoever wrote it.

The everysec window: SIGKILL alone loses nothing (the OS still holds what Redis wrote to the AOF);
what everysec risks is an OS crash or power cut losing the last second of un-fsynced AOF. The
tests reproduce that by truncating the AOF to the size it had a moment earlier before restarting.
"""

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from rollflash.broker.config.config import load_config
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from rollflash.broker.connect.keys import GEN_GROUP, RunKeys
from rollflash.broker.connect.redis_io import RunLost
from rollflash.broker.connect.redis_server import EmbeddedRedis
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from tests.faults.harness import wait_until

FP = load_config(None).fingerprint()
KEYS = RunKeys("r")


def _server(tmp_path: Path, fsync: str | None) -> EmbeddedRedis:
    aof = (
        [
            "--appendonly",
            "yes",
            "--appendfsync",
            fsync,
            "--save",
            "",
            "--auto-aof-rewrite-percentage",
            "0",
        ]
        if fsync
        else []
    )
    return EmbeddedRedis(tmp_path / "redis", persistence=fsync is not None, extra_args=aof).start()


def _work(i: int) -> PromptWork:
    return PromptWork(
        prompt_id=f"train-{i}",
        group_id=f"g{i:09d}",
        n=1,
        issued_version=0,
        item={"id": f"train-{i}", "prompt": f"{i}+1=", "answer": str(i + 1)},
    )


def _traj(work: PromptWork, generator: str = "gen-0") -> Trajectory:
    s = Sample(
        np.array([5], np.int32), np.array([-0.5], np.float32), np.array([0], np.int32), 1.0, True
    )
    return Trajectory(
        work.group_id,
        work.prompt_id,
        work.group_id,
        generator,
        0,
        0,
        np.array([1], np.int32),
        [s],
        retried=work.retried,
        mac=work.mac,
    )


CHECK = (10, 1, 0)  # vocabulary 10, one sample a group, the learner at version 0


def _pair(
    server: EmbeddedRedis, timeout_s: float = 20.0, watch_interval_s: float = 1.0
) -> tuple[LearnerBroker, GeneratorBroker]:
    learner = LearnerBroker(
        connect(server.url, timeout_s),
        "r",
        100_000,
        busy_timeout_s=5,
        watch_interval_s=watch_interval_s,
        lease_ttl_s=600,
    )
    learner.take_lease()
    learner.ensure_groups()
    learner.register_run(FP)
    return learner, _join(server, learner, "gen-0", timeout_s)


def _join(server, learner, gid: str, timeout_s: float = 20.0) -> GeneratorBroker:
    """A generator process `gid` joining the run (the learner admits it)."""
    gen = GeneratorBroker(connect(server.url, timeout_s), "r", gid, 100_000, busy_timeout_s=5)
    gen.ask_to_join({"state": "up"}, ttl_s=600)
    learner.roster.admit_joined()
    gen.join_run(FP, timeout_s=5)
    learner.maintain_now()
    return gen


def _generate(gen: GeneratorBroker, count: int) -> list[str]:
    """What a generator's turn does: own pending first, then new prompts; returns group ids."""
    claimed = gen.claim_prompts(count, block_ms=0, own_pending=True) or gen.claim_prompts(
        count, block_ms=100
    )
    for entry_id, w in claimed:
        gen.add_trajectory(_traj(w), entry_id)
    return [w.group_id for _, w in claimed]


def _aof_incr(server: EmbeddedRedis) -> Path:
    (path,) = (server.dir / "appendonlydir").glob("*.incr.aof")
    return path


def _written_aof_size(server: EmbeddedRedis) -> int:
    """The AOF's size once Redis has written everything it acknowledged: under appendfsync
    everysec it may hold back its write() for up to 2 s while a background fsync is still running
    (a slow disk), and the file alone would then miss commands that were already acknowledged."""
    admin = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + 120  # only a hang reaches it
    while admin.info("persistence")["aof_buffer_length"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admin.info("persistence")["aof_buffer_length"] == 0, "Redis held its AOF write back"
    return _aof_incr(server).stat().st_size


def _power_cut(server: EmbeddedRedis, durable: int) -> None:
    """Kill Redis and keep only the first `durable` bytes of its AOF (what had been fsynced),
    then start it again: an OS crash or power cut under appendfsync everysec."""
    server.kill()
    with open(_aof_incr(server), "r+b") as f:
        f.truncate(durable)
    server.start()


def test_calls_ride_out_a_restart_and_always_loses_nothing(tmp_path):
    server = _server(tmp_path, "always")
    try:
        # a timeout above the test's waits: the read below waits out however long the restart takes
        learner, gen = _pair(server, timeout_s=600)
        learner.add_prompts([_work(i) for i in range(4)])
        assert _generate(gen, 2) == ["g000000000", "g000000001"]
        server.kill()
        # a read issued while Redis is down blocks, reconnects with backoff, then succeeds
        # (redis-server is started from this thread: PR_SET_PDEATHSIG ties it to its creator)
        retry = learner.io.client.get_retry()  # counts the attempts that lost their connection
        failures = retry.failures
        got: dict = {}

        def read() -> None:
            try:
                got["out"] = learner.read_trajectories("rank0", 10, 100, CHECK)
                got["at"] = time.monotonic()
            except Exception as e:  # shown by the assertion after the join
                got["error"] = e

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: retry.failures > failures, 120, "the read to meet the killed Redis")
        restarted_at = time.monotonic()
        server.start()
        reader.join(timeout=120)
        assert not reader.is_alive() and "out" in got, f"the read did not come back: {got}"
        good, _ = got["out"]
        assert got["at"] > restarted_at
        assert [t.traj_id for _, t in good] == ["g000000000", "g000000001"]
        learner.check_intact()
        assert learner.verify_prompts() == 0
        assert _generate(gen, 4) == ["g000000002", "g000000003"]
        assert gen.lost["trajectories"] == 0 and learner.lost["prompts"] == 0
    finally:
        server.stop()


def test_redis_down_longer_than_the_timeout_fails_with_one_clear_error(tmp_path):
    server = _server(tmp_path, None)
    learner, _ = _pair(server, timeout_s=1.5)
    server.kill()
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=r"cannot reach Redis at unix://.* in 2s") as e:
        learner.read_trajectories("rank0", 10, 100, CHECK)
    # it gives up at the first failure past the timeout: at most 5 attempts (at 0, 0.2, 0.6,
    # 1.4 and 1.5 s: 0.2 + 0.4 + 0.8 + the 1.6 cut to 0.1 at the deadline), fewer on a slow
    # machine, and never before 1.5 s after the first one
    attempts = int(re.search(r"after (\d+) attempts", str(e.value))[1])
    assert 2 <= attempts <= 5, str(e.value)
    assert time.monotonic() - started >= 1.5


@pytest.mark.parametrize(
    "how", ["restart without persistence", "group destroyed", "stream deleted"]
)
def test_a_redis_that_lost_the_run_is_reported_and_nothing_is_recreated(tmp_path, how):
    server = _server(tmp_path, None)
    try:
        # the learner's reads re-check that Redis holds the run every time, not once a second
        learner, gen = _pair(server, watch_interval_s=0.0)
        learner.add_prompts([_work(i) for i in range(2)])
        ((entry_id, work),) = gen.claim_prompts(1, block_ms=100)
        admin = redis.Redis.from_url(server.url)
        if how == "restart without persistence":
            server.kill()
            server.start()
            missing = "run hash"
        elif how == "group destroyed":
            admin.xgroup_destroy(KEYS.trajectories("gen-0"), "learner")
            missing = "consumer group 'learner'"
        else:
            admin.delete(KEYS.prompts)
            missing = "stream rl:r:prompts"
        with pytest.raises(RunLost, match=missing):
            learner.check_intact()
        calls = {"learner read": lambda: learner.read_trajectories("rank0", 1, 10, CHECK)}
        if how != "group destroyed":  # the learner's group: only the learner uses it
            calls["claim"] = lambda: gen.claim_prompts(1, block_ms=10)
            calls["prompts"] = lambda: learner.add_prompts([_work(9)])
        if how == "restart without persistence":
            calls["trajectory"] = lambda: gen.add_trajectory(_traj(work), entry_id)
        for call in calls.values():
            with pytest.raises(RunLost, match="Redis no longer holds run rl:r:"):
                call()
        if how == "restart without persistence":
            with pytest.raises(RunLost, match="run hash"):
                gen.run_state()  # a generator's per-turn check (its ACL has no XINFO)
            assert admin.keys("rl:r:*") == []  # nothing was silently re-created
        if how == "stream deleted":
            assert not admin.exists(KEYS.prompts)
    finally:
        server.stop()


def test_everysec_window_forgotten_prompts_and_trajectories_are_recovered_and_counted(tmp_path):
    server = _server(tmp_path, "everysec")
    try:
        learner, gen = _pair(server)
        learner.add_prompts([_work(i) for i in range(3)])
        assert _generate(gen, 2) == ["g000000000", "g000000001"]
        durable = _written_aof_size(server)  # what survives the simulated power cut
        learner.add_prompts([_work(i) for i in range(3, 5)])
        assert _generate(gen, 2) == ["g000000002", "g000000003"]  # acknowledged, then forgotten
        _power_cut(server, durable)
        learner.check_intact()
        assert learner.verify_prompts() == 2  # g3, g4 were forgotten: added again
        assert learner.run_fields()["redis_lost_prompts"] == "2"
        admin = redis.Redis.from_url(server.url)
        stream = [f[b"group_id"].decode() for _, f in admin.xrange(KEYS.prompts)]
        assert stream == [f"g{i:09d}" for i in range(5)]
        # g2's delivery and trajectory were forgotten: it comes back, and gen-0 knows it did it
        regenerated = _generate(gen, 10)
        assert regenerated == ["g000000002", "g000000003", "g000000004"]
        assert gen.lost["trajectories"] == 2  # g2 and g3
        good, _ = learner.read_trajectories("rank0", 10, 100, CHECK)
        assert sorted(t.traj_id for _, t in good) == [f"g{i:09d}" for i in range(5)]
        assert admin.xpending(KEYS.prompts, GEN_GROUP)["pending"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("after_restart", ["another generator takes over", "its writer restarts"])
def test_everysec_forgotten_trajectories_of_a_dead_writer_are_counted_by_the_learner(
    tmp_path, after_restart
):
    server = _server(tmp_path, "everysec")
    try:
        learner, gen = _pair(server)
        learner.track_trajectory_writes()
        learner.add_prompts([_work(i) for i in range(6)])
        claimed = gen.claim_prompts(5, block_ms=100)  # g0..g4, delivered to gen-0

        def write(k: int) -> None:
            gen.add_trajectory(_traj(claimed[k][1]), claimed[k][0])

        write(0), write(1)
        durable = _written_aof_size(server)  # what survives the simulated power cut
        write(2), write(3)  # acknowledged, then forgotten
        assert learner.verify_trajectories() == 0  # its look: 4 entries, the last one g3's
        write(4)  # after the learner's last look: the residual window
        # gen-0 dies (kill -9) with the only memory of having written g2..g4
        _power_cut(server, durable)
        if after_restart == "another generator takes over":
            other = _join(server, learner, "gen-1")
            redo = other.reclaim_prompts(min_idle_ms=0, count=10)
        else:  # a new process with the same id and an empty memory
            other = _join(server, learner, "gen-0")
            redo = other.claim_prompts(10, None, own_pending=True)
        assert [w.group_id for _, w in redo] == ["g000000002", "g000000003", "g000000004"]
        redo += other.claim_prompts(10, block_ms=100)  # and g5, never claimed before
        for entry_id, w in redo:
            other.add_trajectory(_traj(w, other.id), entry_id)
        assert other.lost["trajectories"] == 0  # the writer that could have told is gone
        # 2 kept + 4 new = 6 > the 4 the learner saw: entries-added alone shows no loss
        admin = redis.Redis.from_url(server.url)
        streams = [KEYS.trajectories(g) for g in ("gen-0", "gen-1")]
        assert sum(admin.xinfo_stream(s)["entries-added"] for s in streams if admin.exists(s)) == 6
        # but g3's entry, the last the learner saw of gen-0's stream, is gone: of the 4 it saw
        # there, 2 are kept (entries-added minus those added after g3's id). Counted at its
        # first look after the restart (the admission of the new process ran one)
        learner.verify_trajectories()
        assert learner.lost["trajectory_writes"] == 2  # g2, g3 (g4 came after its last look)
        assert learner.run_fields()["redis_lost_trajectory_writes"] == "2"
        assert learner.verify_trajectories() == 0  # re-based: each loss is counted once
        good, _ = learner.read_trajectories("rank0", 10, 100, CHECK)
        assert sorted(t.traj_id for _, t in good) == [f"g{i:09d}" for i in range(6)]
        # every prompt delivered again says so, g4 included: the learner, which never saw g4's
        # first trajectory, counts it as retried (learner/intake/collect.py), so no loss goes uncounted
        assert sorted(t.traj_id for _, t in good if t.retried) == [
            "g000000002",
            "g000000003",
            "g000000004",
        ]
    finally:
        server.stop()


def test_everysec_forgotten_weights_announcement_is_made_again(tmp_path):
    server = _server(tmp_path, "everysec")
    try:
        learner, gen = _pair(server)
        learner.announce_weights(1, "/w/v1", "sha-1", "tcp://x")
        durable = _written_aof_size(server)
        learner.announce_weights(2, "/w/v2", "sha-2", "tcp://x")  # acknowledged, then forgotten
        assert learner.verify_weights() is False
        _power_cut(server, durable)
        assert gen.weights()["version"] == "1"  # a generator waiting for v2 would wait forever
        assert learner.verify_weights() is True
        assert {k: gen.weights()[k] for k in ("version", "path", "sha256")} == {
            "version": "2",
            "path": "/w/v2",
            "sha256": "sha-2",
        }
        assert learner.lost["weights"] == 1 and learner.verify_weights() is False
    finally:
        server.stop()
