"""Backpressure with real processes.

- The learner stalls (SIGSTOP): generators finish what admission let in, (v + 1 + a) * B prompts
  at most, and then wait; no entry that is not yet acknowledged was trimmed, and after SIGCONT
  every step completes with every group trained once.
- Redis at maxmemory with noeviction refuses writes: generators and the learner back off instead
  of crashing, and training finishes once memory is available again.
"""

import math
import os
import signal
import time

import pytest
import redis
from harness import (
    generator_fields,
    start,
    steps_done,
    stop_all,
    streams,
    trained_ids,
    wait_until,
    write_config,
)

from rollflash.broker.connect.redis_server import EmbeddedRedis

STEPS, B, RATIO = 8, 4, 1


def _produced(r, run_id) -> int:
    return sum(int(g.get("groups", 0)) for g in generator_fields(r, run_id).values())


def _added(r, stream) -> int:
    """Entries ever added to `stream` (XLEN less what trimming removed)."""
    return r.xinfo_stream(stream)["entries-added"]


def _counts(r, run_id) -> tuple[int, int, int]:
    """(prompts issued, trajectories written, groups the generators report)."""
    written = sum(_added(r, s) for s in streams(r, run_id))
    return _added(r, f"rl:{run_id}:prompts"), written, _produced(r, run_id)


def test_a_stalled_learner_caps_producers_and_nothing_is_trimmed(
    tmp_path, redis_url, run_id, fault_report
):
    config = write_config(
        tmp_path,
        redis_url,
        run_id,
        STEPS,
        B,
        # the stopped learner's clock runs on: its wait for data must outlast the stall
        trainer={"async_ratio": RATIO, "wait_timeout_s": 300},
        rollout={"heartbeat_ttl_s": 60},
    )
    run_dir = tmp_path / "run"
    r = redis.Redis.from_url(redis_url)
    prompts = f"rl:{run_id}:prompts"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        os.kill(learner.pid, signal.SIGSTOP)
        version = int(r.hget(f"rl:{run_id}:run", "version"))
        # generators drain what was admitted (one trajectory per prompt) and their heartbeat
        # counters catch up with the stream; waited for, not slept, so a slow machine only waits
        # longer. Then nothing may move: the learner issues no prompt while it is stopped.
        wait_until(
            lambda: len(set(_counts(r, run_id))) == 1,
            120,
            "generators to answer every admitted prompt",
        )
        before = _counts(r, run_id)
        time.sleep(1.5)  # a window for a generator that would keep producing to show itself
        after = _counts(r, run_id)
        os.kill(learner.pid, signal.SIGCONT)
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
        for g in gens:
            assert g.wait(timeout=30) == 0
        every = [prompts, *streams(r, run_id)]
        info = {s: r.xinfo_stream(s) for s in every}
        groups = {s: r.xinfo_groups(s)[0] for s in every}
    finally:
        stop_all([learner, *gens])
    # the learner was at `version` (or just publishing version + 1): admission's cap
    cap = math.floor((version + 2 + RATIO) * B)
    assert before == after, "producers kept going while the learner was stalled"
    assert after[1] <= after[0] <= cap
    for stream in every:  # trimming took only acknowledged entries
        assert info[stream]["length"] >= groups[stream]["pending"] + groups[stream]["lag"]
    # the stall left no prompt behind (it drained above); at the end only prompts admitted for
    # steps that never came may still be waiting: issued - trained - replaced at most
    replaced = int(r.hget(f"rl:{run_id}:run", "replaced") or 0)
    assert groups[prompts]["lag"] <= info[prompts]["entries-added"] - STEPS * B - replaced
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * B
    fault_report(
        "learner stalled (SIGSTOP until drained)",
        injected=1,
        recovered=1,
        lost=0,
        reported="-",
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=0,
    )


def _refusals(proc) -> int:
    """How many refused writes (Redis at maxmemory) the process has logged so far."""
    return sum("maxmemory" in line for line in proc.stderr_text().splitlines())


def test_redis_at_maxmemory_makes_processes_back_off_not_crash(tmp_path, run_id, fault_report):
    server = EmbeddedRedis(
        tmp_path / "redis", extra_args=["--maxmemory-policy", "noeviction"]
    ).start()
    # processes wait out a refusal for up to redis.connect_timeout_s and a learner without data
    # gives up after trainer.wait_timeout_s: both far above the time this test holds Redis at
    # maxmemory, however slowly the machine runs
    config = write_config(
        tmp_path,
        server.url,
        run_id,
        STEPS,
        B,
        redis={"connect_timeout_s": 300},
        trainer={"wait_timeout_s": 300},
    )
    run_dir = tmp_path / "run"
    admin = redis.Redis.from_url(server.url)
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 60, "two learner steps")
        admin.config_set("maxmemory", 1)  # below what it uses: every write is refused (OOM)
        refused_from = steps_done(run_dir)
        with pytest.raises(redis.exceptions.OutOfMemoryError):  # the fault is in place
            admin.set(f"rl:{run_id}:probe", "x")
        # No fixed sleep: wait until each generator has met a refused write and tried it again
        # after backing off (it logs every refusal; its heartbeat writes at least every second),
        # then check that nobody crashed. A refusal that was not waited out would have ended the
        # process with an error before its second attempt (the wait stops early if one exits).
        wait_until(
            lambda: (
                all(_refusals(g) >= 2 for g in gens)
                or any(p.poll() is not None for p in (learner, *gens))
            ),
            120,
            "both generators to retry",
        )
        alive = [p.poll() is None for p in (learner, *gens)]
        # while every write is refused the learner cannot publish: at most the step in flight
        # completes (this holds however slow a step is; the lines above show the fault was met)
        stalled = steps_done(run_dir) <= refused_from + 1
        admin.config_set("maxmemory", 0)
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
        for g in gens:
            assert g.wait(timeout=30) == 0, g.stderr_text()[-3000:]
    finally:
        stop_all([learner, *gens])
        server.stop()
    assert alive == [True, True, True], [p.stderr_text()[-1000:] for p in (learner, *gens)]
    assert stalled, "the learner kept publishing while Redis refused every write"
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * B
    fault_report(
        "redis at maxmemory (noeviction, until refused twice)",
        injected=1,
        recovered=1,
        lost=0,
        reported="-",
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=0,
    )
