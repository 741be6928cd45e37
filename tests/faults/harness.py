"""Helpers for the fault suite: a run config for the simulated engine, real learner and generator
processes started through `rollctl`, and what a finished run left behind (ledger, heartbeats,
streams), from which the tests compute what was lost and duplicated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import yaml


def write_config(
    tmp_path: Path, redis_url: str, run_id: str, steps: int, batch: int, **sections
) -> Path:
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        "redis": {"url": redis_url, "connect_timeout_s": 20},
        "eval": {"size": 1},
        "rollout": {
            "engine": "sim",
            "num_return_sequences": 2,
            "max_new_tokens": 64,
            "prompts_per_pull": 1,
        },
        "sim": {
            "per_token_s": 0.002,
            "length_median": 20,
            "length_sigma": 0.3,
            "learner_step_s": 0.1,
        },
        "trainer": {
            "rollout_batch_size": batch,
            "total_steps": steps,
            "async_ratio": 1,
            "wait_timeout_s": 60,
        },
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Child(subprocess.Popen):
    """A `rollctl` process whose stderr goes to a file beside the run's config, never to a pipe:
    a pipe that the test reads only after `wait()` fills up (64 KiB) and blocks a chatty child
    forever. The child's descriptor is opened for appending, so a test may read the log while the
    child still writes (`stderr_text`)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            super().__init__(args, stdout=subprocess.DEVNULL, stderr=log, env=env)

    def stderr_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def start(role: str, config: Path, *extra: str, env: dict[str, str] | None = None) -> Child:
    fd, log_path = tempfile.mkstemp(prefix=f"{role}-", suffix=".stderr", dir=config.parent)
    os.close(fd)
    return Child(
        [sys.executable, "-m", "rollflash.rollctl.cli", role, "--config", str(config), *extra],
        Path(log_path),
        {**os.environ, **(env or {})},
    )


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def trained_ids(run_dir: Path) -> list[str]:
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [g for row in rows for g in row["trained"]]


def dropped_duplicates(run_dir: Path) -> int:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return int(sum(m.get("async/duplicates", 0) for m in rows))


def generator_fields(r: redis.Redis, run_id: str) -> dict[str, dict[str, str]]:
    out = {}
    for key in r.scan_iter(match=f"rl:{run_id}:gen:*"):
        fields = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        out[key.decode().rsplit(":", 1)[1]] = fields
    return out


def acknowledged_not_stored(r: redis.Redis, run_id: str) -> int:
    """Trajectory writes generators were told succeeded (their `groups` counters: one trajectory
    per prompt) minus the writes the stream holds (`entries-added` survives restarts)."""
    acked = sum(int(g["groups"]) for g in generator_fields(r, run_id).values())
    return acked - r.xinfo_stream(f"rl:{run_id}:trajectories")["entries-added"]


def learner_lag(r: redis.Redis, run_id: str) -> int | None:
    """Trajectory entries not yet delivered to the learner's consumer group."""
    groups = r.xinfo_groups(f"rl:{run_id}:trajectories")
    return next(g["lag"] for g in groups if g["name"] == b"learner")


# How many XINFO STREAM calls to wait for so that the learner has looked at the trajectories
# stream twice: its watch (broker/streams.py `watch`) makes one such call on the trajectories
# stream and at most one on the prompts stream, so any 4 consecutive calls hold two trajectory
# looks; Redis < 7 counts all XINFO subcommands together, 3-4 per watch, so 8 calls are needed
# there (and are plenty on Redis 7). Two looks, because the second is sent only after the learner
# has taken in the first one's answer.
LOOKS_PER_TWO_WATCHES = 8


def stream_looks(r: redis.Redis) -> int:
    """XINFO STREAM calls the server has executed (XINFO calls on Redis < 7)."""
    stats = r.info("commandstats")
    return int(stats.get("cmdstat_xinfo|stream", stats.get("cmdstat_xinfo", {})).get("calls", 0))


def status_text(config: Path) -> str:
    """What `rollctl status` prints for the run."""
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "status", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def last_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def traj_ids(r: redis.Redis, run_id: str) -> set[str]:
    return {f[b"traj_id"].decode() for _, f in r.xrange(f"rl:{run_id}:trajectories")}


def resp_commands(data: bytes) -> list[list[bytes]]:
    """Parse an AOF fragment (RESP arrays of bulk strings) into commands."""
    out, i = [], 0
    while i < len(data):
        assert data[i : i + 1] == b"*", f"not RESP at byte {i}"
        end = data.index(b"\r\n", i)
        n, i = int(data[i + 1 : end]), end + 2
        cmd = []
        for _ in range(n):
            end = data.index(b"\r\n", i)
            size, i = int(data[i + 1 : end]), end + 2
            cmd.append(data[i : i + size])
            i += size + 2
        out.append(cmd)
    return out


def xadds(commands: list[list[bytes]], key: str) -> list[dict[str, str]]:
    """The field maps of the XADDs to `key` among `commands`."""
    out = []
    for c in commands:
        if c[0].upper() == b"XADD" and c[1] == key.encode():
            args = c[2:]
            start = next(i for i, a in enumerate(args) if b"-" in a and a[:1].isdigit()) + 1
            pairs = args[start:]
            out.append(
                {
                    pairs[i].decode(): pairs[i + 1].decode(errors="replace")
                    for i in range(0, len(pairs) - 1, 2)
                    if pairs[i] != b"data"
                }
            )
    return out
