"""Redis restarts under a real run: a learner and generators (simulated engine) as processes, and
a redis-server of the test's own, killed with SIGKILL mid-training and started again from its
directory.

- appendfsync always: the processes reconnect with backoff, training finishes, and every
  trajectory a generator was told was stored is still in Redis; nothing is trained twice.
- appendfsync everysec, power cut: SIGKILL alone loses nothing (the OS holds what Redis wrote), so
  the test also truncates the AOF to its size one second earlier, which is what an OS crash inside
  the everysec window leaves. Training finishes; the writes that second held (counted from the
  erased AOF tail itself) are exactly the ones the system reports: prompts re-added by the
  learner, trajectories regenerated and counted by the generator.
- no persistence: Redis comes back empty; learner and generators stop with one line naming what
  is gone, and the streams are not re-created.
"""

import time

import pytest
import redis

from broker.redis_server import EmbeddedRedis
from harness import (acknowledged_not_stored, dropped_duplicates, generator_fields,
                     resp_commands, start, steps_done, stop_all, trained_ids, traj_ids,
                     wait_until, write_config, xadds)

STEPS, B = 10, 4


def _redis(tmp_path, fsync):
    aof = ["--appendonly", "yes", "--appendfsync", fsync, "--save", "",
           "--auto-aof-rewrite-percentage", "0"] if fsync else []
    return EmbeddedRedis(tmp_path / "redis", persistence=fsync is not None,
                         extra_args=aof).start()


def _incr_aof(server):
    (path,) = (server.dir / "appendonlydir").glob("*.incr.aof")
    return path


@pytest.mark.parametrize("fsync, power_cut, generators", [("always", False, 2),
                                                          ("everysec", True, 1)])
def test_redis_restart_mid_training(tmp_path, run_id, fault_report, fsync, power_cut, generators):
    server = _redis(tmp_path, fsync)
    config = write_config(tmp_path, server.url, run_id, STEPS, B)
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(generators)]
    learner = start("start-learner", config)
    erased = []
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        durable = _incr_aof(server).stat().st_size
        time.sleep(1.0)  # the everysec window: written, acknowledged, maybe not yet fsynced
        server.kill()
        if power_cut:
            aof = _incr_aof(server)
            erased = resp_commands(aof.read_bytes()[durable:])
            with open(aof, "r+b") as f:
                f.truncate(durable)
        time.sleep(1.0)
        server.start()
        assert learner.wait(timeout=120) == 0, learner.stderr.read()[-3000:]
        logs = []
        for g in gens:
            assert g.wait(timeout=30) == 0, g.stderr.read()[-3000:]
            logs += [x for x in g.stderr.read().splitlines() if "forgot" in x]
        r = redis.Redis.from_url(server.url)
        trained = trained_ids(run_dir)
        missing = acknowledged_not_stored(r, run_id)
        stored = traj_ids(r, run_id)
        reported_traj = sum(int(g["redis_lost"]) for g in generator_fields(r, run_id).values())
        reported_prompts = int(r.hget(f"rl:{run_id}:run", "redis_lost_prompts") or 0)
        stored_prompts = {f[b"group_id"] for _, f in r.xrange(f"rl:{run_id}:prompts")}
    finally:
        stop_all([learner, *gens])
        server.stop()
    erased_traj = xadds(erased, f"rl:{run_id}:trajectories")
    erased_prompts = xadds(erased, f"rl:{run_id}:prompts")
    assert len(trained) == len(set(trained)) == STEPS * B  # every step complete, none twice
    # every write the power cut erased is one Redis lacks; a kill -9 under everysec may lose a
    # few more (a write Redis postpones while an fsync runs is only in its memory)
    assert missing >= len(erased_traj)
    # each erased write is back: regenerated (trajectories) or re-added (prompts)
    unrecovered = [t["traj_id"] for t in erased_traj if t["traj_id"] not in stored] + \
        [p["group_id"] for p in erased_prompts if p["group_id"].encode() not in stored_prompts]
    assert unrecovered == []
    # and the system counted what it lost: never silent. It may count one more per generator: a
    # write in flight at the crash, re-sent after the restart, whose prompt Redis forgot.
    assert reported_prompts == len(erased_prompts)
    assert missing <= reported_traj <= missing + generators, str((
        sorted(t["traj_id"] for t in erased_traj), [x[-90:] for x in logs]))
    if power_cut:
        assert erased_traj, "the simulated power cut erased no trajectory: nothing was tested"
    lost = missing + len(erased_prompts)
    fault_report(f"redis kill -9, appendfsync {fsync}" + (" + power cut" if power_cut else ""),
                 injected=1, recovered=int(not unrecovered), lost=lost,
                 reported=reported_traj + reported_prompts,
                 duplicated=len(trained) - len(set(trained)),
                 dropped_duplicates=dropped_duplicates(run_dir))


def test_redis_back_empty_stops_the_run_with_a_clear_error(tmp_path, run_id, fault_report):
    server = _redis(tmp_path, None)
    config = write_config(tmp_path, server.url, run_id, 1000, B)
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        server.kill()
        server.start()  # empty: no AOF, no snapshot
        codes = [p.wait(timeout=60) for p in (learner, *gens)]
        errors = [p.stderr.read().strip().splitlines()[-1] for p in (learner, *gens)]
        r = redis.Redis.from_url(server.url)
        recreated = [k for k in ("prompts", "trajectories") if r.exists(f"rl:{run_id}:{k}")]
    finally:
        stop_all([learner, *gens])
        server.stop()
    assert codes == [2, 2, 2], errors
    for line in errors:
        assert line.startswith("rollctl: error: Redis no longer holds run"), errors
    assert recreated == []
    fault_report("redis back empty (no persistence)", injected=1, recovered=0,
                 lost="all", reported=f"{len(codes)}/{len(codes)} stop", duplicated=0,
                 dropped_duplicates=0)
