"""`rollctl run` owns its run directory (rollctl/supervise.py), with real processes and a real
redis-server (`--redis-url`, so the test can audit Redis afterwards):
- a generator killed with SIGKILL under it is started again and the run completes (with one
  generator, the run can only complete through the restarted one);
- its learner killed with SIGKILL: it frees that learner's lease and says so, and the same
  command resumes at once;
- SIGTERM to `rollctl run`: the learner stops at a step boundary, checkpointed, one line says
  so, exit code 143, and the same command resumes at once.
Each run ends with the ledger audit clean (tests/faults/test_learner_stop.py)."""

import os
import signal
import subprocess
import sys

import redis
from harness import steps_done, wait_until, write_config
from test_learner_stop import _audit_and_finish

from rollflash.broker.connect.keys import RunKeys

STEPS, B = 30, 4  # 0.3 s a step (sim.learner_step_s): the run outlasts a generator's restart
SIM = {"per_token_s": 0.001, "length_median": 16, "length_sigma": 0.5, "learner_step_s": 0.3}


class Run(subprocess.Popen):
    """`rollctl run --config CONFIG --generators N`, its output in files beside the config."""

    def __init__(self, config, generators: int):
        self.out, self.err = config.parent / "run.out", config.parent / "run.err"
        args = [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(config)]
        with open(self.out, "ab") as out, open(self.err, "ab") as err:
            super().__init__([*args, "--generators", str(generators)], stdout=out, stderr=err)

    def child(self, marker: str) -> int:
        """The pid of the child whose command line holds `marker`."""
        found = []
        for entry in os.listdir("/proc"):
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                args = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
            except (OSError, IndexError):
                continue  # not a process, or gone
            if int(stat[1]) == self.pid and marker in args:
                found.append(int(entry))
        (pid,) = found
        return pid

    def text(self) -> tuple[str, str]:
        return self.out.read_text(), self.err.read_text()


def _config(tmp_path, redis_url, run_id):
    return write_config(
        tmp_path, redis_url, run_id, STEPS, B, sim=SIM, trainer={"checkpoint_every": 4}
    )


def test_a_killed_generator_is_started_again_and_the_run_completes(tmp_path, redis_url, run_id):
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    run = Run(config, generators=1)
    wait_until(lambda: steps_done(run_dir) >= 2 or run.poll() is not None, 600, "step 2")
    os.kill(run.child("--id gen-0"), signal.SIGKILL)  # its only generator
    assert run.wait(timeout=600) == 0, run.text()
    out, _ = run.text()
    assert "generator gen-0 was killed by SIGKILL; restarting it in 1s (restart 1 of 5)" in out
    assert (run_dir / "logs" / "gen-0.log.1").is_file()  # the killed one's log, kept
    r = redis.Redis.from_url(redis_url)
    _audit_and_finish(r, run_id, run_dir, [], STEPS)


def test_its_learner_killed_the_same_command_resumes_at_once(tmp_path, redis_url, run_id):
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    r = redis.Redis.from_url(redis_url)
    run = Run(config, generators=2)
    wait_until(lambda: steps_done(run_dir) >= 5 or run.poll() is not None, 600, "step 5")
    learner = run.child("start-learner")
    os.kill(learner, signal.SIGKILL)
    assert run.wait(timeout=600) == 137, run.text()
    out, err = run.text()
    assert f"freed the run's lease held by the learner (pid {learner}), which died" in out
    assert err.strip().splitlines()[-1] == (
        "the learner was killed by SIGKILL; the same command resumes the run from its last "
        "checkpoint"
    )
    assert not r.exists(RunKeys(run_id).lease)
    latest = int((run_dir / "checkpoints" / "LATEST").read_text())
    again = Run(config, generators=2)  # the same command, at once
    assert again.wait(timeout=600) == 0, again.text()
    assert "has a learner already" not in (run_dir / "logs" / "learner.log").read_text()
    _audit_and_finish(r, run_id, run_dir, [latest], STEPS)


def test_sigterm_stops_it_with_one_line_and_the_same_command_resumes(tmp_path, redis_url, run_id):
    run_dir, config = tmp_path / "run", _config(tmp_path, redis_url, run_id)
    r = redis.Redis.from_url(redis_url)
    run = Run(config, generators=2)
    wait_until(lambda: steps_done(run_dir) >= 3 or run.poll() is not None, 600, "step 3")
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=600) == 143, run.text()
    _, err = run.text()
    assert err.strip().splitlines()[-1] == (
        "rollctl: stopped by SIGTERM; stopped the learner and 2 generator(s) (the same command "
        "resumes the run)"
    )
    log = (run_dir / "logs" / "learner.log").read_text()
    stopped_at = int(log.split("rollctl: stopped by SIGTERM after step ")[1].split(":")[0])
    assert int((run_dir / "checkpoints" / "LATEST").read_text()) == stopped_at
    assert not r.exists(RunKeys(run_id).lease)
    again = Run(config, generators=2)
    assert again.wait(timeout=600) == 0, again.text()
    _audit_and_finish(r, run_id, run_dir, [stopped_at], STEPS)
