"""The Python API stopped and started again, as a notebook does: `Run(...).train()` interrupted
(SIGINT: a notebook's stop button, a terminal's Ctrl-C) stops the learner at a step boundary and
raises KeyboardInterrupt; `train()` again resumes at once, without waiting for a lease, and
the ledger audit is clean. `take_over=True` takes the lease of a learner known to be dead,
which a plain `train()` refuses. Real processes, a real redis-server."""

import json
import subprocess
import sys
import textwrap

import redis
from harness import write_config
from test_learner_stop import _audit_and_finish

from rollflash.broker.connect.keys import RunKeys

STEPS, B = 30, 4
SIM = {"per_token_s": 0.001, "length_median": 16, "length_sigma": 0.5, "learner_step_s": 0.3}

NOTEBOOK = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from pathlib import Path

    import yaml
    from rollflash import Run

    config = yaml.safe_load(Path(sys.argv[1]).read_text())
    metrics = Path(config["run"]["run_dir"]) / "metrics.jsonl"
    run = Run(config, echo=False, rollout={"num_rollout_workers": 2})

    def stop_button():
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=stop_button, daemon=True).start()
    try:
        run.train()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print(json.dumps(run.train().summary), flush=True)
    """
)

TAKE_OVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import yaml
    from rollflash import Run
    from rollflash.rollctl.api import RunFailed

    config = yaml.safe_load(Path(sys.argv[1]).read_text())
    try:
        Run(config, echo=False).train()
    except RunFailed as e:
        print(f"refused: {e}", flush=True)
    print(Run(config, echo=False, take_over=True).train().summary["steps"], flush=True)
    """
)


def _python(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=1200
    )


def test_train_interrupted_then_train_again_resumes_at_once(tmp_path, redis_url, run_id):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, redis_url, run_id, STEPS, B, sim=SIM)
    out = _python(NOTEBOOK, str(config))
    assert out.returncode == 0, out.stderr[-3000:]
    first, summary = out.stdout.strip().splitlines()
    assert first == "interrupted"
    assert json.loads(summary)["steps"] == STEPS
    logs = run_dir / "logs"
    stopped = (logs / "learner.log.1").read_text()  # the first learner's log, kept
    stopped_at = int(stopped.split("rollctl: stopped by SIGTERM after step ")[1].split(":")[0])
    assert "has a learner already" not in (logs / "learner.log").read_text()
    r = redis.Redis.from_url(redis_url)
    _audit_and_finish(r, run_id, run_dir, [stopped_at], STEPS)


def test_take_over_takes_the_lease_of_a_dead_learner(tmp_path, redis_url, run_id):
    config = write_config(tmp_path, redis_url, run_id, 3, B, sim=SIM)
    r = redis.Redis.from_url(redis_url)
    lease = RunKeys(run_id).lease  # a learner on another host died holding it
    r.hset(lease, mapping={"token": "x", "host": "elsewhere", "pid": "4242", "since": "1.0"})
    r.pexpire(lease, 600_000)
    out = _python(TAKE_OVER, str(config))
    assert out.returncode == 0, out.stderr[-3000:]
    refused, steps = out.stdout.strip().splitlines()
    assert refused.startswith("refused: ")
    assert steps == "3"
    log = (tmp_path / "run" / "logs" / "learner.log.1").read_text()
    assert "has a learner already (host elsewhere, pid 4242" in log
