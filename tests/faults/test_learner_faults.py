"""Learner crashes with real processes and a real redis-server: the learner is kill -9'd inside a
chosen window and started again (`--take-over`: the test knows the holder of the run's lease is
dead) while the generators keep running.

The learner stops itself with SIGSTOP at the window (a hook at learner/process/hooks.py's fault points,
installed through its environment by tests/faults/learner_pause.py), and the test sends the
SIGKILL, so every run hits
exactly the window it names:
- after_read: step 5's groups were read but neither trained nor acknowledged;
- after_update: step 5 was trained and published, but its checkpoint (every 3 steps) not written;
- after_checkpoint: step 6's checkpoint is durable, its entries not yet acknowledged;
- before_ack: dropped entries of a step recorded in the ledger, not yet acknowledged.
Afterwards the surviving lineage (the ledger with the rows of rolled-back steps removed) must have
trained every delivered trajectory exactly once, every entry the learner acknowledged must have
exactly one ledger record (the ledger audit, tests/faults/harness.py), whatever is left pending
must be held untrained for a continued run (tests/helpers/held.py), the model must hold exactly
`total_steps` updates, and versions must only increase.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import learner_pause
import pytest
import redis
import torch
import torch.distributed.checkpoint as dcp
from harness import ledger_audit, ledgers, start, stop_all, wait_until, write_config

from rollflash.broker.weights.weights import WeightStore
from tests.helpers import ledger_files as ledger_rows
from tests.helpers.held import held_at_end

STEPS, B, EVERY = 10, 4, 3
SIM = {"per_token_s": 0.001, "length_median": 16, "length_sigma": 0.5}  # sim generators


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


def trained_rows(ledger: list[dict]) -> list[dict]:
    """The trained rows of the final lineage (tests/helpers/ledger_files.py `surviving`)."""
    return [row for row in ledger_rows.surviving(ledger) if row.get("event") is None]


def _kill_at(config, window: str, *extra: str):
    """Start a learner that stops itself at `window` ("point:step"), and SIGKILL it there."""
    learner = start("start-learner", config, *extra, env=learner_pause.env(window))
    wait_until(
        lambda: _stopped(learner.pid) or learner.poll() is not None,
        120,
        f"the learner to reach {window}",
    )
    assert learner.poll() is None, learner.stderr_text()[-3000:]
    learner.send_signal(signal.SIGKILL)
    learner.wait()


def _audit(r, run_id, run_dir):
    """Exactly one ledger record for every acknowledged entry; nothing trained twice; what is
    still pending is held, untrained, for a continued run (tests/helpers/held.py)."""
    audit = ledger_audit(r, run_id, run_dir)
    assert audit["unrecorded"] == 0 and audit["multiple"] == [], audit
    assert audit["recorded"] == audit["acknowledged"] and audit["trained_twice"] == 0, audit
    audit["held"] = len(held_at_end(r, run_id, run_dir))
    return audit


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
        sim=SIM,
        trainer={"checkpoint_every": EVERY},
    )
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        _kill_at(config, f"{window}:{step}")
        second = start("start-learner", config, "--take-over")
        assert second.wait(timeout=120) == 0, second.stderr_text()[-3000:]
    finally:
        stop_all(gens)

    r = redis.Redis.from_url(redis_url)
    (ledger,) = ledgers(run_dir)
    resume = [row for row in ledger if row.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == (6 if window == "after_checkpoint" else 3)
    rows = trained_rows(ledger)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * B  # nothing trained twice
    dropped = {t for row in ledger for k in ("stale", "late", "filtered") for t in row.get(k, [])}
    assert not dropped & set(trained)
    # every entry the learner group acknowledged is trained or recorded as dropped, once; each
    # pending one answers a prompt issued beyond the trained ones (async_ratio 1: up to B more)
    audit = _audit(r, run_id, run_dir)
    # versions only increase; the model holds exactly STEPS updates (one per trained step)
    versions = [row["version"] for row in ledger if "version" in row]
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
    assert audit["held"] <= final["prompts_issued"] - STEPS * B
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
    from rollflash.broker.weights.weights import WeightStore

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
        _kill_at(config, "after_update:5")
        second = start("start-learner", config, "--take-over")
        assert second.wait(timeout=180) == 0, second.stderr_text()[-3000:]
    finally:
        stop_all(gens)

    (ledger,) = ledgers(run_dir)
    assert [row["step"] for row in ledger if row.get("event") == "resume"] == [3]
    rows = trained_rows(ledger)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == steps * B  # nothing trained twice
    _audit(redis.Redis.from_url(redis_url), run_id, run_dir)
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


def _replicated(tmp_path, redis_url, run_id, steps: int, batch: int, every: int):
    """A run of replicated prompts with one redundant sample: every group leaves a late sample
    to drop (and record) in most steps, so `before_ack` is reached."""
    return write_config(
        tmp_path,
        redis_url,
        run_id,
        steps,
        batch,
        sim=SIM,
        rollout={"replicate_prompts": True, "redundant_samples": 1},
        trainer={"checkpoint_every": every},
    )


def test_three_kill_9s_leave_one_ledger_record_per_acknowledged_entry(
    tmp_path, redis_url, run_id, fault_report
):
    """Three crashes of the learner, each in another window, the second between a ledger record
    of dropped entries and their acknowledgement. Prompts are replicated with one redundant
    sample, so every group leaves a late sample to drop (and record) in every step."""
    steps, run_dir = 8, tmp_path / "run"
    config = _replicated(tmp_path, redis_url, run_id, steps, B, EVERY)
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        _kill_at(config, "after_read:5")  # resumes from the checkpoint of step 3
        _kill_at(config, "before_ack:5", "--take-over")  # from step 3 again
        _kill_at(config, "after_checkpoint:6", "--take-over")  # from step 6
        last = start("start-learner", config, "--take-over")
        assert last.wait(timeout=180) == 0, last.stderr_text()[-3000:]
    finally:
        stop_all(gens)
    r = redis.Redis.from_url(redis_url)
    (ledger,) = ledgers(run_dir)
    assert [row["step"] for row in ledger if row.get("event") == "resume"] == [3, 3, 6]
    assert [row["step"] for row in trained_rows(ledger)] == list(range(1, steps + 1))
    audit = _audit(r, run_id, run_dir)
    late = [t for row in ledger for t in row.get("late", [])]
    assert len(late) >= steps * B // 2  # the drops the audit covers: one per group, most steps
    fault_report(
        "learner kill -9 x3 (read, record-before-ack, checkpoint)",
        injected=3,
        lost=0,
        recovered=3,
        duplicated=audit["trained_twice"],
        unrecorded=audit["unrecorded"],
    )


def test_kill_9_at_every_point_before_the_first_checkpoint_then_the_run_completes(
    tmp_path, redis_url, run_id, fault_report
):
    """A learner killed after it published v0 and before its first checkpoint made nothing
    durable: its successor starts again from the initial weights at step 0 (learner/build.py
    `resume_point`), with the prompts and counters Redis recorded. Seven kill -9s in a row, one
    at each fault point from the start to the first checkpoint (step 5, the last): the lease
    taken (nothing published: the next learner starts afresh), v0 handed to the publishing
    process, and each point of steps 1 and 3, the last after steps 1-3 were trained and 1-2
    logged. Prompts are
    replicated with one redundant sample, so a step drops late samples (`before_ack`). The
    eighth learner completes the run: every step trained once in the final lineage, every
    acknowledged entry recorded once, versions only increasing, each step once in
    metrics.jsonl."""
    steps, b, run_dir = 5, 2, tmp_path / "run"
    config = _replicated(tmp_path, redis_url, run_id, steps, b, every=steps)
    windows = ["after_lease:0", "after_start:0", "after_read:1", "before_ack:1",
               "after_update:1", "after_read:3", "after_update:3"]  # fmt: skip
    published = []  # whether weights existed after each kill
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        for n, window in enumerate(windows):
            extra = ("--take-over",) if n else ()  # the killed learner's lease is still live
            _kill_at(config, window, *extra)
            assert not (run_dir / "checkpoints" / "LATEST").exists()
            published.append(bool(WeightStore(run_dir).versions()))
        last = start("start-learner", config, "--take-over")
        assert last.wait(timeout=180) == 0, last.stderr_text()[-3000:]
    finally:
        stop_all(gens)
    (ledger,) = ledgers(run_dir)
    # after_lease: nothing published; after_start: v0 handed to the publishing process, on
    # disk or not (it may need the stopped learner to pass it the weights); from after_read:1
    # on, v0 is out (generators answered prompts of v0). Every learner that found weights
    # resumed, from step 0; the others started afresh
    assert published[0] is False and all(published[2:])
    assert [row["step"] for row in ledger if row.get("event") == "resume"] == [0] * sum(published)
    rows = trained_rows(ledger)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == steps * b  # nothing trained twice
    audit = _audit(redis.Redis.from_url(redis_url), run_id, run_dir)
    versions = [row["version"] for row in ledger if "version" in row]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # each step once, in order
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["steps"] == final["steps_this_process"] == steps
    assert checkpoint_weight(run_dir / "checkpoints" / f"step{steps:08d}").tolist() == [5.0] * 4
    fault_report(
        "learner kill -9 x7 before its first checkpoint",
        injected=len(windows),
        lost=0,
        recovered=len(windows),
        duplicated=audit["trained_twice"],
        unrecorded=audit["unrecorded"],
    )
