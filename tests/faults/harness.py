"""Helpers for the fault suite: a run config for the simulated engine, real learner and generator
processes started through `rollctl`, and what a finished run left behind (ledger, heartbeats,
streams), from which the tests compute what was lost and duplicated.

Accounting is Jepsen's (its queue checker): a write is acknowledged (its writer got the reply),
or indeterminate (the reply was lost with the connection and the call re-sent: stored once,
twice, or not at all); a lost write is an acknowledged one Redis does not hold. Counts an
indeterminate write can move are bounds, never equalities (`write_accounting`). The learner's
side is audited from its ledger (`ledger_audit`): every entry it acknowledged has exactly one
record, and no trajectory is trained twice."""

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

from tests.helpers import ledger_files as ledger


def write_config(
    tmp_path: Path, redis_url: str, run_id: str, steps: int, batch: int, **sections
) -> Path:
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        # no model directory: the simulated engine and learner give prompts one id per character
        "model": {"path": str(tmp_path / "no-model")},
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


def start(
    role: str,
    config: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    wrapper: Path | None = None,
) -> Child:
    """`rollctl <role> --config <config> <extra>`; `wrapper`: a script that installs a test's
    hooks in the process, then runs rollctl (tests/faults/relay_pause.py)."""
    fd, log_path = tempfile.mkstemp(prefix=f"{role}-", suffix=".stderr", dir=config.parent)
    os.close(fd)
    cli = [str(wrapper)] if wrapper is not None else ["-m", "rollflash.rollctl.cli"]
    return Child(
        [sys.executable, *cli, role, "--config", str(config), *extra],
        Path(log_path),
        {**os.environ, **(env or {})},
    )


def rollctl_run(config: Path, generators: int = 1) -> subprocess.CompletedProcess:
    """`rollctl run --config CONFIG --generators N` to its end, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(config)]
        + ["--generators", str(generators)],
        capture_output=True,
        text=True,
        timeout=900,  # bounds a hang: the command ends by itself
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


def ledgers(run_dir: Path) -> list[list[dict]]:
    """Every rank's ledger rows (learner/durability/ledger.py)."""
    return [ledger.read([p]) for p in sorted(run_dir.glob("ledger*.jsonl"))]


def trained_ids(run_dir: Path) -> list[str]:
    """The traj_ids trained in the final lineage, with repeats (a duplicate shows twice)."""
    return ledger.trained_ids(ledgers(run_dir))


def streams(r: redis.Redis, run_id: str) -> list[str]:
    """Every generator's trajectories stream of the run."""
    return sorted(k.decode() for k in r.scan_iter(match=f"rl:{run_id}:traj:*"))


def ledger_audit(r: redis.Redis, run_id: str, run_dir: Path, skip: set[str] = frozenset()) -> dict:
    """Entries the learner acknowledged, per Redis (each stream's learner group: entries read
    minus pending), against the ledger's records: `acknowledged`, `recorded` (entries with a
    record), `unrecorded` (acknowledged without one, counted per stream), `multiple` (entries
    with more than one record) and `trained_twice` (traj_ids trained more than once).
    `skip`: generators whose streams' counters another client made meaningless (an attacker
    deleting entries the learner had not read yet) are not counted."""
    records = ledger.audit(ledgers(run_dir))
    acknowledged = unrecorded = 0
    for stream in streams(r, run_id):
        if stream.rsplit(":", 1)[1] in skip:
            continue
        group = next(g for g in r.xinfo_groups(stream) if g["name"] == b"learner")
        if group["entries-read"] is None:  # Redis cannot count it (entries deleted, a power cut)
            continue
        acked = group["entries-read"] - group["pending"]
        gen = stream.rsplit(":", 1)[1]
        mine = sum(1 for ref in records if ref.split("/", 1)[0] == gen)
        acknowledged += acked
        unrecorded += max(0, acked - mine)
    trained = trained_ids(run_dir)
    return {
        "acknowledged": acknowledged,
        "recorded": len(records),
        "unrecorded": unrecorded,
        "multiple": sorted(ref for ref, outcomes in records.items() if len(outcomes) > 1),
        "trained_twice": len(trained) - len(set(trained)),
    }


def write_accounting(r: redis.Redis, run_id: str) -> dict[str, int]:
    """Trajectory writes, Jepsen-style, summed over the generators: `acknowledged` (heartbeat
    `published`), `indeterminate` (re-sent after a lost connection), `stored` (entries-added of
    their streams, which survives trimming and restarts), and the bounds on `lost`, the
    acknowledged writes Redis does not hold: stored = acknowledged - lost + (indeterminate ones
    that landed), so acknowledged - stored <= lost <= acknowledged - stored + indeterminate."""
    gens = generator_fields(r, run_id)
    acked = sum(int(g["published"]) for g in gens.values())
    indeterminate = sum(int(g["indeterminate"]) for g in gens.values())
    stored = sum(r.xinfo_stream(s)["entries-added"] for s in streams(r, run_id))
    return {
        "acknowledged": acked,
        "indeterminate": indeterminate,
        "stored": stored,
        "lost_at_least": max(0, acked - stored),
        "lost_at_most": max(0, acked - stored + indeterminate),
    }


def dropped_duplicates(run_dir: Path) -> int:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return int(sum(m.get("async/duplicates", 0) for m in rows))


def generator_fields(r: redis.Redis, run_id: str) -> dict[str, dict[str, str]]:
    out = {}
    for key in r.scan_iter(match=f"rl:{run_id}:gen:*"):
        fields = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        out[key.decode().rsplit(":", 1)[1]] = fields
    return out


def written_by(r: redis.Redis, run_id: str, run_dir: Path) -> dict[str, set[str]]:
    """traj_id -> the generators whose entries of it Redis still holds or the learner recorded
    (trained, or dropped as a duplicate, ...), for whole groups (one entry each)."""
    out: dict[str, set[str]] = {}
    for stream in streams(r, run_id):
        for _, f in r.xrange(stream):
            out.setdefault(f[b"traj_id"].decode(), set()).add(f[b"generator"].decode())
    for rows in ledgers(run_dir):
        for row in ledger.surviving(rows):
            if row.get("event") is None:
                pairs = zip(row["trained"], row["refs"])
            else:
                pairs = (p for k, refs in row["refs"].items() for p in zip(row[k], refs))
            for traj_id, ref in pairs:
                out.setdefault(traj_id, set()).add(ref.split("/")[0])
    return out


def learner_lag(r: redis.Redis, run_id: str) -> int | None:
    """Trajectory entries not yet delivered to the learner's consumer group, over every
    generator's stream."""
    lags = []
    for stream in streams(r, run_id):
        lags.append(next(g["lag"] for g in r.xinfo_groups(stream) if g["name"] == b"learner"))
    return None if None in lags else sum(lags)


def looks_for_two_watches(streams: int) -> int:
    """How many XINFO STREAM calls to wait for so that the learner's rank 0 has looked at every
    trajectories stream twice. Its watch (broker/sides/learner_side.py `maintain`) makes at most
    3 * streams + 1 of them (the loss auditor's look at each stream, the check of each stream
    inside its function, the lost-prompt snapshot's, and one on the prompts stream), so any
    3 * (3 * streams + 1) consecutive calls hold two whole watches. Two, because the second
    is sent only after the learner has taken in the first one's answer."""
    return 3 * (3 * streams + 1)


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


def traj_ids(r: redis.Redis, run_id: str, run_dir: Path) -> set[str]:
    """The traj_ids Redis holds (what trimming left of each stream) or that the learner
    recorded in its ledger (trained or dropped: they were stored)."""
    held = {f[b"traj_id"].decode() for s in streams(r, run_id) for _, f in r.xrange(s)}
    recorded = set()
    for rows in ledgers(run_dir):
        for row in ledger.surviving(rows):
            for outcome in ledger.OUTCOMES:
                recorded.update(row.get(outcome, []))
    return held | recorded


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
    """The field maps of the XADDs to `key` (a trailing `*`: any key with that prefix) among
    `commands`."""
    out = []
    for c in commands:
        name = c[1].decode(errors="replace") if len(c) > 1 else ""
        if c[0].upper() != b"XADD":
            continue
        if name == key or (key.endswith("*") and name.startswith(key[:-1])):
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
