"""Redis restarts under a real run: a learner and generators (simulated engine) as processes, and
a redis-server of the test's own, killed with SIGKILL mid-training and started again from its
directory.

- appendfsync always: the processes reconnect with backoff, training finishes, no trajectory a
  generator was told was stored is lost (Jepsen's accounting, tests/faults/harness.py: a write
  whose reply the kill took is indeterminate, not lost), and nothing is trained twice; the
  learner's ledger has exactly one record for every entry it acknowledged.
- appendfsync everysec, power cut: SIGKILL alone loses nothing (the OS holds what Redis wrote), so
  the test also truncates the AOF to its size one second earlier, which is what an OS crash inside
  the everysec window leaves. Training finishes; the writes that second held (counted from the
  erased AOF tail itself) are exactly the ones the system reports: prompts re-added by the
  learner, trajectories regenerated and counted by the generator (and, for those the learner had
  seen, by the learner too).
- appendfsync everysec, power cut after the writer died: a generator is killed with SIGKILL, so
  nobody remembers what it wrote; Redis then comes back without that second, and another
  generator regenerates the forgotten trajectories. The learner counts every forgotten write it
  had seen (here: all, the survivor is frozen until it has looked), whoever wrote it.
- no persistence: Redis comes back empty; learner and generators stop with one line naming what
  is gone, and the streams are not re-created.
"""

import os
import signal
import time

import pytest
import redis
from harness import (
    dropped_duplicates,
    generator_fields,
    last_metrics,
    learner_lag,
    ledger_audit,
    looks_for_two_watches,
    resp_commands,
    start,
    status_text,
    steps_done,
    stop_all,
    stream_looks,
    trained_ids,
    traj_ids,
    wait_until,
    write_accounting,
    write_config,
    written_by,
    xadds,
)

from rollflash.broker.channels.audit import WATCH_INTERVAL_S
from rollflash.broker.connect.redis_server import EmbeddedRedis

STEPS, B = 10, 4


def _redis(tmp_path, fsync):
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


def _incr_aof(server):
    (path,) = (server.dir / "appendonlydir").glob("*.incr.aof")
    return path


def _erase_tail(server, durable: int) -> list[list[bytes]]:
    """What a power cut inside the everysec window leaves: the AOF as it was at `durable` bytes.
    Returns the erased commands."""
    aof = _incr_aof(server)
    erased = resp_commands(aof.read_bytes()[durable:])
    with open(aof, "r+b") as f:
        f.truncate(durable)
    return erased


@pytest.mark.parametrize(
    "fsync, power_cut, generators", [("always", False, 2), ("everysec", True, 1)]
)
def test_redis_restart_mid_training(tmp_path, run_id, fault_report, fsync, power_cut, generators):
    server = _redis(tmp_path, fsync)
    # trainer.wait_timeout_s above the start-up wait below: generators started first wait that
    # long for the learner to register the run
    config = write_config(tmp_path, server.url, run_id, STEPS, B, trainer={"wait_timeout_s": 300})
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(generators)]
    learner = start("start-learner", config)
    erased = []
    try:
        # three processes importing torch on a loaded 2-core machine: seen to take over three
        # minutes (a bound on a hang, not on speed)
        wait_until(lambda: steps_done(run_dir) >= 2, 600, "two learner steps")
        durable = _incr_aof(server).stat().st_size
        time.sleep(1.0)  # the everysec window: written, acknowledged, maybe not yet fsynced
        server.kill()
        if power_cut:
            erased = _erase_tail(server, durable)
        time.sleep(1.0)
        server.start()
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
        logs = []
        for g in gens:
            assert g.wait(timeout=300) == 0, g.stderr_text()[-3000:]
            logs += [x for x in g.stderr_text().splitlines() if "forgot" in x]
        r = redis.Redis.from_url(server.url)
        trained = trained_ids(run_dir)
        writes = write_accounting(r, run_id)
        audit = ledger_audit(r, run_id, run_dir)
        stored = traj_ids(r, run_id, run_dir)
        reported_traj = sum(int(g["redis_lost"]) for g in generator_fields(r, run_id).values())
        reported_prompts = int(r.hget(f"rl:{run_id}:run", "redis_lost_prompts") or 0)
        by_learner = int(r.hget(f"rl:{run_id}:run", "redis_lost_trajectory_writes") or 0)
        issued = set(r.hkeys(f"rl:{run_id}:inflight")) | {t.encode() for t in stored}
    finally:
        stop_all([learner, *gens])
        server.stop()
    erased_traj = xadds(erased, f"rl:{run_id}:traj:*")
    erased_prompts = xadds(erased, f"rl:{run_id}:prompts")
    assert len(trained) == len(set(trained)) == STEPS * B  # every step complete, none twice
    # Jepsen's accounting: stored = acknowledged - lost + the indeterminate writes that landed.
    # The writes Redis lost are exactly the ones the power cut erased (a kill -9 under everysec
    # may lose a few more: a write Redis postpones while an fsync runs is only in its memory)
    lost = (writes["lost_at_least"], writes["lost_at_most"])
    assert lost[0] <= len(erased_traj) <= lost[1] if power_cut else lost[0] == 0, writes
    # each erased write is back: regenerated (trajectories) or re-added (prompts)
    unrecovered = [t["traj_id"] for t in erased_traj if t["traj_id"] not in stored] + [
        p["group_id"] for p in erased_prompts if p["group_id"].encode() not in issued
    ]
    assert unrecovered == []
    # and the system counted what it lost: never silent. It may count one more per generator: a
    # write in flight at the crash, re-sent after the restart, whose prompt Redis forgot.
    assert reported_prompts == len(erased_prompts)
    assert lost[0] <= reported_traj <= lost[1] + generators, str(
        (writes, sorted(t["traj_id"] for t in erased_traj), [x[-90:] for x in logs])
    )
    # the learner counts the forgotten writes it had seen (not those of the last moments before
    # the cut): at most every forgotten write, in-flight ones included
    assert by_learner <= lost[1] + generators
    if power_cut:
        assert erased_traj, "the simulated power cut erased no trajectory: nothing was tested"
    else:
        assert by_learner == 0
        # nothing was lost, so the learner's ledger accounts for every entry it acknowledged
        assert audit["unrecorded"] == 0 and audit["multiple"] == [], audit
    lost = len(erased_traj) + len(erased_prompts)
    fault_report(
        f"redis kill -9, appendfsync {fsync}" + (" + power cut" if power_cut else ""),
        injected=1,
        recovered=int(not unrecovered),
        lost=lost,
        reported=max(reported_traj, by_learner) + reported_prompts,
        by_learner=by_learner,
        by_writers=reported_traj,
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=dropped_duplicates(run_dir),
        indeterminate=writes["indeterminate"],
        unrecorded="-" if power_cut else audit["unrecorded"],
    )


@pytest.mark.slow  # 30 steps around a kill, a freeze and a restart: about a minute
def test_everysec_power_cut_after_the_writer_died_is_counted_by_the_learner(
    tmp_path, run_id, fault_report
):
    server = _redis(tmp_path, "everysec")
    # the learner waits for data while the survivor is frozen: far longer than that may take
    config = write_config(
        tmp_path,
        server.url,
        run_id,
        3 * STEPS,
        B,
        rollout={"reclaim_idle_s": 2},
        trainer={"wait_timeout_s": 300},
    )
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 600, "two learner steps")
        durable = _incr_aof(server).stat().st_size
        time.sleep(1.0)  # the everysec window: both generators write
        gens[0].kill()  # SIGKILL the writer: nobody remembers what it wrote
        gens[0].wait()
        os.kill(gens[1].pid, signal.SIGSTOP)  # no more writes, so the learner can see them all
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: learner_lag(r, run_id) == 0, 300, "the learner to read everything")
        # and to look at the complete stream once more (its watch, every WATCH_INTERVAL_S):
        # waited for by counting the learner's looks in Redis, not by sleeping
        looked = stream_looks(r)
        wait_until(
            lambda: stream_looks(r) >= looked + looks_for_two_watches(2),
            300 + 10 * WATCH_INTERVAL_S,
            "the learner to look at the stream again",
        )
        server.kill()
        erased = _erase_tail(server, durable)
        server.start()
        os.kill(gens[1].pid, signal.SIGCONT)
        assert learner.wait(timeout=600) == 0, learner.stderr_text()[-3000:]
        assert gens[1].wait(timeout=300) == 0, gens[1].stderr_text()[-3000:]
        logs = [x[-90:] for x in gens[1].stderr_text().splitlines() if "forgot" in x]
        writers = written_by(r, run_id, run_dir)
        run = {k.decode(): v.decode() for k, v in r.hgetall(f"rl:{run_id}:run").items()}
        answered = traj_ids(r, run_id, run_dir)
        by_writers = int(generator_fields(r, run_id)["gen-1"]["redis_lost"])
        status = status_text(config)
        trained = trained_ids(run_dir)
        metrics = last_metrics(run_dir)
    finally:
        if gens[1].poll() is None:
            os.kill(gens[1].pid, signal.SIGCONT)  # a stopped process would ignore SIGTERM
        stop_all([learner, *gens])
        server.stop()
    erased_traj = xadds(erased, f"rl:{run_id}:traj:*")
    erased_prompts = xadds(erased, f"rl:{run_id}:prompts")
    dead_writers = [t["traj_id"] for t in erased_traj if t["generator"] == "gen-0"]
    assert dead_writers, "the power cut erased nothing the killed generator wrote: nothing tested"
    assert len(trained) == len(set(trained)) == 3 * STEPS * B  # every step complete, none twice
    # each of the dead writer's forgotten trajectories was generated again, by the survivor
    assert all("gen-1" in writers.get(t, ()) for t in dead_writers), (dead_writers, writers)
    assert all(t["traj_id"] in answered for t in erased_traj)
    # the learner had seen every write the cut erased, so it counts each of them, once
    n = len(erased_traj)
    assert run["redis_lost_trajectory_writes"] == str(n), (run, sorted(dead_writers))
    assert metrics["redis/lost_trajectory_writes"] == n
    assert f"trajectory_writes={n} (learner's count)" in status, status
    # the survivor counts only its own, give or take the write it had in flight when it froze
    # (re-sent after the restart: one fewer if the copy acknowledged the prompt, one more if
    # the prompt was forgotten and comes back); the dead writer's are counted by nobody else
    survivor = n - len(dead_writers)
    assert survivor - 1 <= by_writers <= survivor + 1, (logs, erased_traj)
    assert f"by their writers={by_writers}" in status
    assert int(run.get("redis_lost_prompts", 0)) == len(erased_prompts)
    assert {p["group_id"] for p in erased_prompts} <= answered  # re-added, then answered
    fault_report(
        "redis everysec power cut, writer kill -9 first",
        injected=2,
        recovered=1,
        lost=n + len(erased_prompts),
        reported=max(n, by_writers) + len(erased_prompts),
        by_learner=n,
        by_writers=by_writers,
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=dropped_duplicates(run_dir),
    )


def test_redis_back_empty_stops_the_run_with_a_clear_error(tmp_path, run_id, fault_report):
    server = _redis(tmp_path, None)
    config = write_config(tmp_path, server.url, run_id, 1000, B)
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 600, "two learner steps")
        server.kill()
        server.start()  # empty: no AOF, no snapshot
        codes = [p.wait(timeout=300) for p in (learner, *gens)]
        errors = [p.stderr_text().strip().splitlines()[-1] for p in (learner, *gens)]
        r = redis.Redis.from_url(server.url)
        recreated = [k.decode() for k in r.keys(f"rl:{run_id}:*") if r.type(k) == b"stream"]
    finally:
        stop_all([learner, *gens])
        server.stop()
    assert codes == [2, 2, 2], errors
    for line in errors:
        assert line.startswith("rollctl: error: Redis no longer holds run"), errors
    assert recreated == []
    fault_report(
        "redis back empty (no persistence)",
        injected=1,
        recovered=0,
        lost="all",
        reported=f"{len(codes)}/{len(codes)} stop",
        duplicated=0,
        dropped_duplicates=0,
    )
