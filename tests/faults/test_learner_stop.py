"""A learner stopped by a signal (how Kubernetes, Slurm, a terminal and `rollctl run` stop it),
with real processes and a real redis-server: it stops at a step boundary, checkpointed, frees the
run's lease and exits 128 + N with one line, so the same command, started the moment it has
exited, resumes at once (no lease to wait for, no --take-over). A second signal stops it at once
with the guarantees of a kill -9. Afterwards the ledger audit (tests/faults/harness.py) must be
clean: every acknowledged entry recorded once, nothing trained twice, every step trained once in
the surviving lineage, whatever is pending held untrained for a continued run."""

import re
import signal
from pathlib import Path

import learner_pause
import redis
from harness import ledger_audit, ledgers, start, steps_done, stop_all, wait_until, write_config

from rollflash.broker.connect.keys import RunKeys
from tests.helpers import ledger_files as ledger_rows
from tests.helpers.held import held_at_end

STEPS, B, EVERY = 10, 4, 4
SIM = {"per_token_s": 0.001, "length_median": 16, "length_sigma": 0.5}  # sim generators


def _config(tmp_path, redis_url, run_id):
    return write_config(
        tmp_path, redis_url, run_id, STEPS, B, sim=SIM, trainer={"checkpoint_every": EVERY}
    )


def _last_line(proc) -> str:
    return proc.stderr_text().strip().splitlines()[-1]


def _audit_and_finish(r, run_id, run_dir, resumed_from: list[int], steps: int = STEPS) -> None:
    """The run ended with every one of its `steps` trained once, from the resume points given."""
    (ledger,) = ledgers(run_dir)
    assert [row["step"] for row in ledger if row.get("event") == "resume"] == resumed_from
    rows = [row for row in ledger_rows.surviving(ledger) if row.get("event") is None]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    trained = [t for row in rows for t in row["trained"]]
    assert len(trained) == len(set(trained)) == steps * B  # nothing trained twice
    audit = ledger_audit(r, run_id, run_dir)
    assert audit["unrecorded"] == 0 and audit["multiple"] == [], audit  # nothing lost
    assert audit["recorded"] == audit["acknowledged"] and audit["trained_twice"] == 0, audit
    held_at_end(r, run_id, run_dir)


def test_sigterm_stops_at_a_step_boundary_and_the_same_command_resumes_at_once(
    tmp_path, redis_url, run_id
):
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    r = redis.Redis.from_url(redis_url)
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        first = start("start-learner", config)
        wait_until(lambda: steps_done(run_dir) >= 2 or first.poll() is not None, 600, "step 2")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == 143, first.stderr_text()[-3000:]
        found = re.fullmatch(
            r"rollctl: stopped by SIGTERM after step (\d+): checkpointed, the run's lease "
            r"released; the same command resumes",
            _last_line(first),
        )
        assert found, first.stderr_text()[-3000:]
        stopped_at = int(found.group(1))
        assert stopped_at < STEPS
        assert not r.exists(RunKeys(run_id).lease)  # the next learner need not wait for it
        assert r.hget(RunKeys(run_id).run, "state") == b"stopped"
        latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
        assert int(latest) == stopped_at  # the steps since the last checkpoint are kept
        second = start("start-learner", config)  # the same command, at once
        assert second.wait(timeout=600) == 0, second.stderr_text()[-3000:]
    finally:
        stop_all(gens)
    assert "has a learner already" not in second.stderr_text()
    _audit_and_finish(r, run_id, run_dir, [stopped_at])


def test_a_learner_waiting_for_groups_stops_without_waiting_them_out(tmp_path, redis_url, run_id):
    """No generator runs: the learner waits for step 1's groups (trainer.wait_timeout_s 60 s,
    after which it would fail with exit 2). SIGINT ends the wait; nothing was trained."""
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    r = redis.Redis.from_url(redis_url)
    learner = start("start-learner", config)
    state = RunKeys(run_id).run
    wait_until(lambda: r.hget(state, "state") == b"training" or learner.poll() is not None, 600,
               "the learner's loop")  # fmt: skip
    learner.send_signal(signal.SIGINT)
    assert learner.wait(timeout=300) == 130, learner.stderr_text()[-3000:]
    assert _last_line(learner) == (
        "rollctl: stopped by SIGINT after step 0: checkpointed, the run's lease released; the "
        "same command resumes"
    )
    assert not r.exists(RunKeys(run_id).lease)
    assert int((run_dir / "checkpoints" / "LATEST").read_text()) == 0  # v0, to resume from
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        again = start("start-learner", config)
        assert again.wait(timeout=600) == 0, again.stderr_text()[-3000:]
    finally:
        stop_all(gens)
    _audit_and_finish(r, run_id, run_dir, [0])


def test_a_second_signal_stops_at_once_with_the_guarantees_of_a_kill(tmp_path, redis_url, run_id):
    """The learner stops itself after step 5's update (trained and published, not yet
    checkpointed: checkpoints every 4 steps); SIGINT and SIGTERM both arrive while it is stopped
    and are handled in that order when it continues: the first asks for a stop, the second
    stops it there. It resumes from the checkpoint of step 4 and trains step 5 again, once in
    the surviving lineage."""
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    r = redis.Redis.from_url(redis_url)
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    try:
        first = start("start-learner", config, env=learner_pause.env("after_update:5"))
        wait_until(lambda: _stopped(first.pid) or first.poll() is not None, 600, "step 5")
        assert first.poll() is None, first.stderr_text()[-3000:]
        first.send_signal(signal.SIGINT)
        first.send_signal(signal.SIGTERM)
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 143, first.stderr_text()[-3000:]
        assert _last_line(first) == (
            "rollctl: stopped at once by a second SIGTERM at step 5: the run's lease released; "
            "the same command resumes from the last checkpoint"
        )
        assert not r.exists(RunKeys(run_id).lease)
        second = start("start-learner", config)
        assert second.wait(timeout=600) == 0, second.stderr_text()[-3000:]
    finally:
        stop_all(gens)
    _audit_and_finish(r, run_id, run_dir, [EVERY])


def _stopped(pid: int) -> bool:
    """True once the process is in the stopped state (it sent itself SIGSTOP)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False
