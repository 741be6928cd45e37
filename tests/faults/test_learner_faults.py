"""Learner crashes with real processes and a real redis-server: the learner is kill -9'd inside a
chosen window and started again while the generators keep running.

The learner stops itself with SIGSTOP at the window (ROLLFLASH_PAUSE_AT, learner/publish.py), and the
test sends the SIGKILL, so every run hits exactly the window it names:
- after_read: step 5's groups were read but neither trained nor acknowledged;
- after_update: step 5 was trained and published, but its checkpoint (every 3 steps) not written;
- after_checkpoint: step 6's checkpoint is durable, its entries not yet acknowledged.
Afterwards the surviving lineage (the ledger with the rows of rolled-back steps removed) must have
trained every delivered trajectory exactly once, nothing may be left unacknowledged, the model
must hold exactly `total_steps` updates, and versions must only increase.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed.checkpoint as dcp
from harness import start, stop_all, wait_until, write_config

STEPS, B, EVERY = 10, 4, 3


def _stopped(pid: int) -> bool:
    """True once the process is in the stopped state (it sent itself SIGSTOP)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def checkpoint_weight(step_dir: Path) -> torch.Tensor:
    """The simulated policy's one weight tensor from a sharded (DCP) checkpoint."""
    target = {"app": {"policy": {"model": {"weight": torch.zeros(4)}}}}
    dcp.load(target, checkpoint_id=str(step_dir / "dcp"), no_dist=True)
    return target["app"]["policy"]["model"]["weight"]


def surviving_rows(ledger: list[dict]) -> list[dict]:
    """Ledger rows of the final lineage: a resume from step s discards the rows of steps > s."""
    rows: list[dict] = []
    for row in ledger:
        if row.get("event") == "resume":
            rows = [r for r in rows if r["step"] <= row["step"]]
        else:
            rows.append(row)
    return rows


@pytest.mark.parametrize(
    "window,step", [("after_read", 5), ("after_update", 5), ("after_checkpoint", 6)]
)
def test_learner_killed_mid_step_resumes_without_loss_or_double_training(
    tmp_path, redis_url, run_id, window, step
):
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path,
        redis_url,
        run_id,
        STEPS,
        B,
        sim={"per_token_s": 0.001, "length_median": 16, "length_sigma": 0.5},
        trainer={"checkpoint_every": EVERY},
    )
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        first = start("start-learner", config, env={"ROLLFLASH_PAUSE_AT": f"{window}:{step}"})
        wait_until(
            lambda: _stopped(first.pid) or first.poll() is not None,
            90,
            f"the learner to reach {window} of step {step}",
        )
        assert first.poll() is None, first.stderr_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start("start-learner", config)
        assert second.wait(timeout=120) == 0, second.stderr_text()[-3000:]
    finally:
        stop_all(gens)

    r = redis.Redis.from_url(redis_url)
    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    resume = [row for row in ledger if row.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == (6 if window == "after_checkpoint" else 3)
    rows = surviving_rows(ledger)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * B  # nothing trained twice
    dropped = {t for row in ledger for k in ("stale", "late", "filtered") for t in row.get(k, [])}
    assert not dropped & set(trained)
    # every trajectory the learner group was handed is trained or accounted for as dropped
    stream = f"rl:{run_id}:trajectories"
    last = next(g for g in r.xinfo_groups(stream) if g["name"] == b"learner")["last-delivered-id"]
    delivered = {f[b"traj_id"].decode() for _, f in r.xrange(stream, max=last)}
    duplicates = {t for row in ledger for t in row.get("duplicate", [])}
    assert delivered <= set(trained) | dropped | duplicates
    assert r.xpending(stream, "learner")["pending"] == 0  # all acknowledged after the checkpoint
    # versions only increase; the model holds exactly STEPS updates (one per trained step)
    versions = [row["version"] for row in ledger]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    status = subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", "status", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"checkpoint_step={STEPS} resumed_from={resume[0]['step']}" in status.stdout
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["steps"] == STEPS and final["final_version"] == versions[-1]
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    weight = checkpoint_weight(run_dir / "checkpoints" / f"step{int(latest):08d}")
    assert int(latest) == STEPS and weight.tolist() == [float(STEPS)] * 4


def test_lora_learner_killed_after_an_update_resumes_exactly_once(
    tmp_path, redis_url, run_id, tiny_model_dir
):
    """The same kill -9 after step 5's update (published as an adapter version, not yet
    checkpointed) with a real LoRA learner on the tiny model: the checkpoint holds only the
    adapters, the resumed learner trains every trajectory once, and the optimiser state holds
    exactly its total_steps updates of the adapters and nothing else."""
    from rollflash.broker.weights import WeightStore

    steps = 6  # checkpoints at 3 and 6; the kill after 5 rolls back to 3
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path,
        redis_url,
        run_id,
        steps,
        B,
        model={"path": str(tiny_model_dir), "lora": {"rank": 4, "target_modules": ["q_proj"]}},
        sim={"per_token_s": 0.001, "length_median": 8, "learner_step_s": 0, "vocab_size": 51},
        rollout={"max_new_tokens": 16},
        trainer={"checkpoint_every": EVERY},
    )
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        first = start("start-learner", config, env={"ROLLFLASH_PAUSE_AT": "after_update:5"})
        wait_until(lambda: _stopped(first.pid) or first.poll() is not None, 120, "after_update")
        assert first.poll() is None, first.stderr.read()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start("start-learner", config)
        assert second.wait(timeout=180) == 0, second.stderr.read()[-3000:]
    finally:
        stop_all(gens)

    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [row["step"] for row in ledger if row.get("event") == "resume"] == [3]
    rows = surviving_rows(ledger)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == steps * B  # nothing trained twice
    r = redis.Redis.from_url(redis_url)
    assert r.xpending(f"rl:{run_id}:trajectories", "learner")["pending"] == 0
    ckpt = run_dir / "checkpoints" / f"step{steps:08d}"
    stored = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    model = [k for k in stored if k.startswith("app.policy.model.")]
    # 1 layer, q_proj only: lora_A and lora_B, the adapters and nothing of the base
    assert sorted(k.split(".")[-3] for k in model) == ["lora_A", "lora_B"]
    updates = {k: torch.zeros(()) for k in stored if k.endswith(".step")}  # AdamW's counts
    dcp.load(updates, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    assert len(updates) == 2 and [int(v) for v in updates.values()] == [steps, steps]
    store = WeightStore(run_dir)
    assert store.manifest(store.latest()).kind == "adapter"
