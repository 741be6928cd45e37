"""A generator with another engine joins a run configured for `hf`, and one whose config differs
where processes must agree is refused with one line naming the key (broker/config/fingerprint.py):
real learner and generator processes on a real Redis."""

import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

pytestmark = pytest.mark.slow


def _rollctl(*args: str, log: Path) -> subprocess.Popen:
    # stderr to a file, never a pipe nobody reads while the process runs
    return subprocess.Popen(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )


def test_a_sim_generator_joins_an_hf_run_and_only_shared_keys_refuse(
    tmp_path, tiny_model_dir, redis_url, run_id
):
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        "model": {"path": str(tiny_model_dir)},
        "task": {"name": "arithmetic"},
        "eval": {"size": 4},
        "rollout": {"engine": "hf", "num_return_sequences": 2, "max_new_tokens": 4},
        "trainer": {"rollout_batch_size": 2, "total_steps": 2, "wait_timeout_s": 120},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    common = ["--config", str(path), "--redis-url", redis_url]
    learner = _rollctl("start-learner", *common, log=tmp_path / "learner.err")
    refused = {
        key: _rollctl(
            "start-generator", *common, "--engine", "sim", "--set", setting, "--id", key,
            log=tmp_path / f"{key}.err",
        )
        for key, setting in (
            ("rollout.temperature", "rollout.temperature=0.7"),
            ("model.path", f"model.path={tmp_path / 'another-model'}"),
        )
    }  # fmt: skip
    # another engine, its options, its own pull size and heartbeat: none of them must agree
    joined = _rollctl(
        "start-generator", *common, "--engine", "sim", "--id", "sim-0",
        "--set", "sim.vocab_size=40", "--set", "sim.per_token_s=0.001",
        "--set", "rollout.prompts_per_pull=1", "--set", "rollout.heartbeat_ttl_s=600",
        log=tmp_path / "sim-0.err",
    )  # fmt: skip
    try:
        for key, proc in refused.items():
            assert proc.wait(timeout=180) == 2
            last = (tmp_path / f"{key}.err").read_text().strip().splitlines()[-1]
            assert last.startswith(
                f"rollctl: error: run rl:{run_id}: was started with another config; keys every "
                f"process must agree on differ: {key} (the run: "
            ), last
            assert last.count("(the run: ") == 1  # the one key that differs, alone
        assert learner.wait(timeout=300) == 0, (tmp_path / "learner.err").read_text()[-3000:]
        assert joined.wait(timeout=60) == 0, (tmp_path / "sim-0.err").read_text()[-3000:]
    finally:
        for p in (learner, joined, *refused.values()):
            p.kill()
    r = redis.Redis.from_url(redis_url)
    streams = [k.decode() for k in r.scan_iter(match=f"rl:{run_id}:traj:*")]
    writers = {s.rsplit(":", 1)[1] for s in streams if r.xinfo_stream(s)["entries-added"]}
    assert writers == {"sim-0"}  # the learner trained 2 steps on the sim generator's groups
    assert r.hget(f"rl:{run_id}:run", "step") == b"2"
