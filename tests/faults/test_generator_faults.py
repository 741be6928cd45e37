"""Generator faults with real processes and a real redis-server: a generator killed with SIGKILL
mid-generation, and one frozen (SIGSTOP) past the reclaim timeout that then wakes up and delivers
a late duplicate. Training must finish, with every group trained exactly once."""

import json
import os
import signal
import time

import redis
import yaml
from harness import ledgers, start, streams, trained_ids, traj_ids, wait_until, write_config

STEPS, B = 10, 4


def _pending_of(r, stream, consumer):
    try:
        return r.xpending_range(stream, "gen", min="-", max="+", count=100, consumername=consumer)
    except redis.ResponseError:  # the learner has not created the group yet
        return []


def test_killed_and_frozen_generators_lose_nothing_and_train_nothing_twice(
    tmp_path, redis_url, run_id
):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"run_id": run_id, "run_dir": str(run_dir), "torch_threads": 1},
                "redis": {"url": redis_url},
                "eval": {"size": 1},
                "rollout": {
                    "engine": "sim",
                    "num_return_sequences": 2,
                    "max_new_tokens": 400,
                    "prompts_per_pull": 1,
                    "reclaim_idle_s": 2.0,
                },
                "sim": {
                    "per_token_s": 0.002,
                    "length_median": 150,
                    "length_sigma": 0.3,
                    "learner_step_s": 0.1,
                },
                "trainer": {
                    "rollout_batch_size": B,
                    "total_steps": STEPS,
                    "async_ratio": 1,
                    "wait_timeout_s": 60,
                },
            }
        )
    )
    r = redis.Redis.from_url(redis_url)
    prompts = f"rl:{run_id}:prompts"
    victims = {
        name: start("start-generator", config, "--id", name) for name in ("victim", "sleeper")
    }
    learner = start("start-learner", config)
    # the learner publishes v0 and issues prompts; wait until each victim is mid-generation
    wait_until(
        lambda: _pending_of(r, prompts, "victim") and _pending_of(r, prompts, "sleeper"),
        60,
        "both victims to claim a prompt",
    )
    victims["victim"].send_signal(signal.SIGKILL)
    victims["sleeper"].send_signal(signal.SIGSTOP)
    frozen = [p["message_id"].decode() for p in _pending_of(r, prompts, "sleeper")]
    healthy = [start("start-generator", config, "--id", f"healthy-{i}") for i in range(2)]
    try:
        # the sleeper's prompt must be taken over while it is frozen
        wait_until(
            lambda: (
                not {p["message_id"].decode() for p in _pending_of(r, prompts, "sleeper")}
                & set(frozen)
            ),
            30,
            "the frozen generator's prompt to be reclaimed",
        )
        os.kill(victims["sleeper"].pid, signal.SIGCONT)  # wakes up and delivers a duplicate
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
    finally:
        for p in [*healthy, *victims.values()]:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                p.wait(timeout=30)
    (ledger,) = ledgers(run_dir)
    trained = trained_ids(run_dir)
    assert len(trained) == STEPS * B and len(set(trained)) == len(trained)
    dups = [g for row in ledger for g in row.get("duplicate", [])]
    assert not set(trained) & set(dups) - set(trained)
    # every prompt the killed generator had claimed was finished by someone else
    assert _pending_of(r, prompts, "victim") == []
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # entries written (entries-added survives trimming) less the distinct traj_ids among them
    # (what the streams still hold, and what the learner recorded of the rest)
    written = sum(r.xinfo_stream(s)["entries-added"] for s in streams(r, run_id))
    duplicates_produced = written - len(traj_ids(r, run_id, run_dir))
    counted = sum(m["async/duplicates"] for m in metrics)
    consumed_dups = len(dups)
    assert counted == consumed_dups <= duplicates_produced
    assert counted >= 1  # the sleeper's late copy reached the learner and was dropped by id
    # the prompts taken over from the dead victim were answered first by their new owner, which
    # says so (`retried`); the learner counts each such first answer
    retried = [t for row in ledger for t in row.get("retried", [])]
    assert len(retried) >= 1 and set(retried) <= set(trained) | {
        g for row in ledger for g in row.get("stale", [])
    }
    assert sum(m["async/retried"] for m in metrics) == len(retried)


def test_a_killed_generator_is_gone_from_status_once_its_heartbeat_expires(
    tmp_path, redis_url, run_id
):
    """kill -9 of a real generator: `rollctl status` shows it alive before, and gone (not alive)
    at most `heartbeat_ttl_s` + 1 s after: its last beat came before the kill, so its hash
    expires within the TTL of the kill, and Redis no longer returns a key once its TTL passed."""
    from rollflash.broker.config.config import load_config
    from rollflash.broker.connect.connection import connect
    from rollflash.broker.sides.learner_side import LearnerBroker
    from rollflash.rollctl.status import collect_status, compact_lines

    ttl = 2.0
    config = write_config(tmp_path, redis_url, run_id, 1, 1, rollout={"heartbeat_ttl_s": ttl})
    cfg = load_config(config)
    learner = LearnerBroker(connect(redis_url, 5), run_id, cfg.redis.max_payload_bytes)
    learner.take_lease()
    learner.ensure_groups()
    learner.register_run(cfg.fingerprint())  # the run the generator joins; no prompts needed
    gen = start("start-generator", config, "--id", "doomed")
    try:
        wait_until(
            lambda: (
                learner.roster.admit_joined() is not None  # what the learner's reads do
                and "doomed" in collect_status(cfg)["generators"]
                and _is_consumer(redis_url, run_id, "doomed")
            ),
            120,
            "the generator's heartbeat and its first read of the prompts",
        )
        assert "doomed" not in collect_status(cfg)["gone"]
    finally:
        gen.kill()  # SIGKILL: no goodbye, its hash stays until its TTL runs out
        gen.wait()
    killed = time.monotonic()
    time.sleep(max(0.0, killed + ttl + 1 - time.monotonic()))
    status = collect_status(cfg)
    assert "doomed" not in status["generators"] and set(status["gone"]) == {"doomed"}
    assert "generators: 0 alive, 1 gone" in compact_lines(status, 1)


def _is_consumer(redis_url, run_id, name) -> bool:
    r = redis.Redis.from_url(redis_url)
    names = {c["name"].decode() for c in r.xinfo_consumers(f"rl:{run_id}:prompts", "gen")}
    return name in names
