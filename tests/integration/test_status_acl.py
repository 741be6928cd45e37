"""`rollctl status --json` under the run's least-privilege users, as the Kubernetes probes run it
(deploy/k8s): the learner's user reads the whole status; a generator's user may not (it reads
only the run, weights and generators hashes), so a generator's probe is refused, not hung."""

import json
import subprocess
import sys

import pytest
import redis

from rollflash.broker.config.config import load_config
from rollflash.broker.connect.acl import generator_acl, generator_user, learner_acl, learner_user
from rollflash.broker.connect.connection import connect
from rollflash.broker.sides.learner_side import LearnerBroker


def _status(url: str, run_id: str) -> subprocess.CompletedProcess:
    args = ["status", "--json", "--redis-url", url, "--set", f"run.run_id={run_id}"]
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def urls(redis_url, run_id):
    admin = redis.Redis.from_url(redis_url)
    names = [learner_user(run_id), generator_user(run_id, "gen-0")]
    admin.execute_command("ACL", "SETUSER", names[0], *learner_acl(run_id, "lpw"))
    admin.execute_command("ACL", "SETUSER", names[1], *generator_acl(run_id, "gen-0", "gpw"))
    sock = redis_url.removeprefix("unix://")
    yield f"unix://{names[0]}:lpw@{sock}", f"unix://{names[1]}:gpw@{sock}"
    admin.execute_command("ACL", "DELUSER", *names)


def test_status_json_runs_under_the_learners_user(urls, run_id):
    learner = LearnerBroker(connect(urls[0], 5), run_id, 100_000)
    learner.take_lease()
    learner.ensure_groups()
    learner.register_run(load_config(None).fingerprint())
    out = _status(urls[0], run_id)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["run"] == run_id
    refused = _status(urls[1], run_id)
    assert refused.returncode != 0 and "may not read the status" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    learner.release()
