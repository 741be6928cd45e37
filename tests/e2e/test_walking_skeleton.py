"""The whole system as real processes: a real redis-server, `rollctl run` starting one learner and
two generator processes, a tiny model. Checks what must hold for any run, not learning quality."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from rollflash.broker.streams import GEN_GROUP, LEARNER_GROUP

STEPS, B, N = 6, 4, 4


@pytest.fixture
def e2e_config(tmp_path, tiny_model_dir, run_id):
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        "model": {"path": str(tiny_model_dir)},
        "task": {"name": "arithmetic"},
        "eval": {"size": 16},
        "rollout": {"num_return_sequences": N, "max_new_tokens": 6, "prompts_per_pull": 1},
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
    # both generators worked and hot-reloaded new weights
    gens = {
        k.decode().rsplit(":", 1)[1]: {f.decode(): v.decode() for f, v in r.hgetall(k).items()}
        for k in r.scan_iter(match=prefix + "gen:*")
    }
    assert set(gens) == {"gen-0", "gen-1"}
    for g in gens.values():
        assert int(g["groups"]) >= 1, gens
        assert int(g["reloads"]) >= 1 and int(g["loaded_version"]) >= 1, gens

    # exactly-once accounting by trajectory id
    produced = [f[b"traj_id"].decode() for _, f in r.xrange(prefix + "trajectories")]
    assert len(produced) == len(set(produced))
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained = [t for row in ledger for t in row["trained"]]
    dropped = [t for row in ledger for t in row["stale"] + row["duplicate"]]
    assert len(trained) == STEPS * B and len(set(trained)) == len(trained)
    assert set(trained).isdisjoint(dropped)
    consumed = set(trained) | set(dropped)
    assert consumed <= set(produced)
    group = {g["name"].decode(): g for g in r.xinfo_groups(prefix + "trajectories")}[LEARNER_GROUP]
    assert group["pending"] == 0  # everything read was acknowledged
    # what was produced but not consumed was never delivered to the learner
    assert group["lag"] == len(produced) - len(consumed)
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
    traj = s["streams"]["trajectories"]
    assert traj["length"] >= 2 * B and traj["groups"][0]["group"] == "learner"
    assert traj["groups"][0]["pending"] == 0
    assert s["streams"]["prompts"]["groups"][0]["group"] == "gen"
    assert s["generators"]["gen-0"]["loaded_version"] in ("1", "2")
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
    assert "weights: v2" in text and "generator gen-0" in text and "trajectories" in text
