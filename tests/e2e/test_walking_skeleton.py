"""The whole system as real processes: a real redis-server, `rollctl run` starting one learner and
two generator processes, a tiny model. Checks what must hold for any run, not learning quality."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from rollflash.broker.connect.keys import GEN_GROUP, LEARNER_GROUP
from tests.helpers.held import held_at_end

STEPS, B, N = 6, 4, 4


@pytest.fixture
def e2e_config(tmp_path, tiny_model_dir, run_id):
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        "model": {"path": str(tiny_model_dir)},
        "task": {"name": "arithmetic"},
        "eval": {"size": 16},
        "rollout": {
            "num_return_sequences": N,
            "max_new_tokens": 6,
            "prompts_per_pull": 1,
            # a generator's status hash outlives its last beat by this much: the tests read it
            # after the run has ended, through `rollctl status` processes that can take tens of
            # seconds each to start on a loaded machine
            "heartbeat_ttl_s": 600,
        },
        "trainer": {
            "rollout_batch_size": B,
            "total_steps": STEPS,
            "async_ratio": 1,
            "wait_timeout_s": 120,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def test_learner_and_two_generators_train_and_consume_every_trajectory_once(
    e2e_config, redis_url, run_id
):
    path, cfg = e2e_config
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--config",
            str(path),
            "--generators",
            "2",
            "--redis-url",
            redis_url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    run_dir = Path(cfg["run"]["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert 0 <= summary["max_staleness"] <= 1  # ceil(async_ratio)

    r = redis.Redis.from_url(redis_url)
    prefix = f"rl:{run_id}:"
    # the version advanced and was published
    assert r.hget(prefix + "weights", "version") == str(STEPS).encode()
    assert (run_dir / "weights" / "LATEST").read_text().strip() == str(STEPS)

    # Only what every schedule guarantees: which generator claims which prompt is a race, and
    # under CPU load one of them may produce nothing at all (it still joins the run and stops).
    # The streams are trimmed as the learner acknowledges entries, so what was written is read
    # from entries-added (which trimming leaves), the ledger and the heartbeats.
    written = {g: r.xinfo_stream(f"{prefix}traj:{g}")["entries-added"] for g in ("gen-0", "gen-1")}
    # every entry passed the learner's checks (a group of another size, an answer to a prompt
    # it never issued or a version it never published would have been dead-lettered)
    assert r.xlen(prefix + "dlq") == 0 and r.hgetall(prefix + "dlq_reasons") == {}
    assert r.hgetall(prefix + "generators") == {
        b"gen-0": b"active", b"gen-0:trimmed": r.hget(prefix + "generators", "gen-0:trimmed"),
        b"gen-1": b"active", b"gen-1:trimmed": r.hget(prefix + "generators", "gen-1:trimmed"),
    }  # fmt: skip
    # admission: at most (v + 1 + a) * B prompts at the final version v, plus replacements
    replaced = int(r.hget(prefix + "run", "replaced") or 0)
    issued = int(r.hget(prefix + "run", "issued"))
    assert issued == r.xinfo_stream(prefix + "prompts")["entries-added"]
    assert issued <= (STEPS + 1 + 1) * B + replaced

    # both generators joined the run and stopped cleanly; each one's counters match its stream,
    # and it loaded a version no newer than the last one
    gens = {
        k.decode().rsplit(":", 1)[1]: {f.decode(): v.decode() for f, v in r.hgetall(k).items()}
        for k in r.scan_iter(match=prefix + "gen:*")
    }
    assert set(gens) == {"gen-0", "gen-1"}
    for gen_id, g in gens.items():
        assert g["state"] == "stopped", gens
        # no retries in this run: one entry per group, and each call came back
        assert int(g["groups"]) == int(g["published"]) == written[gen_id], (gens, written)
        assert int(g["samples"]) == N * written[gen_id] and g["indeterminate"] == "0", gens
        assert 0 <= int(g["loaded_version"]) <= STEPS, gens

    # exactly-once accounting by trajectory id, with every trained group fresh enough
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    steps = [row for row in ledger if row.get("event") is None]
    assert [(row["step"], row["version"]) for row in steps] == [(s, s) for s in range(1, STEPS + 1)]
    trained = [t for row in steps for t in row["trained"]]
    dropped = [t for row in ledger for k in ("stale", "duplicate") for t in row.get(k, [])]
    assert [len(row["trained"]) for row in steps] == [B] * STEPS
    assert len(set(trained)) == len(trained)
    assert set(trained).isdisjoint(dropped)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= m["async/staleness_max"] <= 1 for m in metrics)  # ceil(a)
    # so the last step trained groups from weights v >= STEPS - 2: generators hot-reloaded
    assert max(int(g["loaded_version"]) for g in gens.values()) >= STEPS - 2

    recorded = sum(len(row["refs"]) if row.get("event") is None else
                   sum(map(len, row["refs"].values())) for row in ledger)  # fmt: skip
    unread = 0
    for gen_id in gens:
        group = {g["name"].decode(): g for g in r.xinfo_groups(f"{prefix}traj:{gen_id}")}
        unread += group[LEARNER_GROUP]["lag"]
    # what is still pending the learner holds, untrained, for a continued run: answers to the
    # prompts issued beyond the trained ones (a = 1: at most B more)
    held = held_at_end(r, run_id, run_dir)
    assert len(held) <= issued - STEPS * B
    # every entry written was recorded in the ledger (once), is held, or was never delivered
    assert recorded + len(held) + unread == sum(written.values())
    # generators acknowledged every prompt they turned into a trajectory
    prompts = {g["name"].decode(): g for g in r.xinfo_groups(prefix + "prompts")}[GEN_GROUP]
    assert prompts["pending"] == 0


def test_status_shows_queues_versions_and_generators(e2e_config, redis_url, run_id):
    path, cfg = e2e_config
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--config",
            str(path),
            "--generators",
            "1",
            "--redis-url",
            redis_url,
            "--set",
            "trainer.total_steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "status",
            "--config",
            str(path),
            "--redis-url",
            redis_url,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    s = json.loads(out.stdout)
    assert s["learner"]["state"] == "done" and s["learner"]["step"] == "2"
    assert s["weights"]["version"] == "2"
    traj = s["streams"]["traj:gen-0"]  # trimmed as the learner acknowledges it
    assert traj["groups"][0]["group"] == "learner" and traj["groups"][0]["pending"] == 0
    assert s["streams"]["prompts"]["groups"][0]["group"] == "gen"
    # the generator as the run left it; with a = 1 all 8 prompts of the 2 steps may be issued at
    # v0 and answered before v1 exists, so it need not have reloaded: its loaded version is only
    # bounded by the versions it generated with and the last one published
    gen = s["generators"]["gen-0"]
    r = redis.Redis.from_url(redis_url)
    stream = f"rl:{run_id}:traj:gen-0"
    used = [int(f[b"behavior_version"]) for _, f in r.xrange(stream)]  # what trimming left
    assert gen["state"] == "stopped"
    assert int(gen["groups"]) == r.xinfo_stream(stream)["entries-added"] >= 2 * B
    assert max(used, default=0) <= int(gen["loaded_version"]) <= 2
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "status",
            "--config",
            str(path),
            "--redis-url",
            redis_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "weights: v2" in text and "generator gen-0" in text and "traj:gen-0" in text
