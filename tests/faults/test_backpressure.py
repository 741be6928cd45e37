"""Backpressure with real processes.

- The learner stalls (SIGSTOP): generators finish what admission let in, (v + 1 + a) * B prompts
  at most, and then wait; nothing is trimmed (each stream holds every entry ever added) and after
  SIGCONT every step completes with every group trained once.
- Redis at maxmemory with noeviction refuses writes: generators and the learner back off instead
  of crashing, and training finishes once memory is available again.
"""

import math
import os
import signal
import time

import redis
from harness import (
    generator_fields,
    start,
    steps_done,
    stop_all,
    trained_ids,
    wait_until,
    write_config,
)

from rollflash.broker.redis_server import EmbeddedRedis

STEPS, B, RATIO = 8, 4, 1


def _produced(r, run_id) -> int:
    return sum(int(g.get("groups", 0)) for g in generator_fields(r, run_id).values())


def test_a_stalled_learner_caps_producers_and_nothing_is_trimmed(
    tmp_path, redis_url, run_id, fault_report
):
    config = write_config(
        tmp_path,
        redis_url,
        run_id,
        STEPS,
        B,
        trainer={"async_ratio": RATIO},
        rollout={"heartbeat_ttl_s": 60},
    )
    run_dir = tmp_path / "run"
    r = redis.Redis.from_url(redis_url)
    prompts, trajectories = f"rl:{run_id}:prompts", f"rl:{run_id}:trajectories"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        os.kill(learner.pid, signal.SIGSTOP)
        version = int(r.hget(f"rl:{run_id}:run", "version"))
        time.sleep(2.0)  # generators drain what was admitted, then have nothing to do
        before = (r.xlen(prompts), r.xlen(trajectories), _produced(r, run_id))
        time.sleep(1.5)
        after = (r.xlen(prompts), r.xlen(trajectories), _produced(r, run_id))
        os.kill(learner.pid, signal.SIGCONT)
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
        for g in gens:
            assert g.wait(timeout=30) == 0
        info = {s: r.xinfo_stream(s) for s in (prompts, trajectories)}
        groups = {s: r.xinfo_groups(s)[0] for s in (prompts, trajectories)}
    finally:
        stop_all([learner, *gens])
    # the learner was at `version` (or just publishing version + 1): admission's cap
    cap = math.floor((version + 2 + RATIO) * B)
    assert before == after, "producers kept going while the learner was stalled"
    assert after[1] <= after[0] <= cap
    for stream in (prompts, trajectories):  # no entry was trimmed or deleted
        assert info[stream]["length"] == info[stream]["entries-added"]
        assert info[stream]["max-deleted-entry-id"] == b"0-0"
    assert groups[prompts]["lag"] == 0  # every prompt was delivered
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * B
    fault_report(
        "learner stalled (SIGSTOP 3.5 s)",
        injected=1,
        recovered=1,
        lost=0,
        reported="-",
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=0,
    )


def test_redis_at_maxmemory_makes_processes_back_off_not_crash(tmp_path, run_id, fault_report):
    server = EmbeddedRedis(
        tmp_path / "redis", extra_args=["--maxmemory-policy", "noeviction"]
    ).start()
    config = write_config(tmp_path, server.url, run_id, STEPS, B)
    run_dir = tmp_path / "run"
    admin = redis.Redis.from_url(server.url)
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        admin.config_set("maxmemory", 1)  # below what it uses: every write is refused (OOM)
        refused_from = steps_done(run_dir)
        time.sleep(3.0)
        alive = [p.poll() is None for p in (learner, *gens)]
        stalled = steps_done(run_dir) <= refused_from + 1  # at most the step in flight
        admin.config_set("maxmemory", 0)
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
        errs = []
        for g in gens:
            assert g.wait(timeout=30) == 0
            errs.append(g.stderr_text())
    finally:
        stop_all([learner, *gens])
        server.stop()
    assert alive == [True, True, True]
    assert stalled, "writes were not refused: the test did not put Redis at maxmemory"
    assert any("maxmemory" in e for e in errs)  # the generators said why they waited
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * B
    fault_report(
        "redis at maxmemory (noeviction, 3 s)",
        injected=1,
        recovered=1,
        lost=0,
        reported="-",
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=0,
    )
