"""A Redis master killed with SIGKILL under a real run behind Sentinel: a learner and two
generators (simulated engine) as processes, a master, its replicas and three Sentinels
(tests/helpers/sentinel_cluster.py), all started by the test.

- one replica: the Sentinels promote it; writes then wait (WAIT 1, broker/connect/sentinel.py) until a
  replica is back, here the killed node restarted as a supervisor would, which the Sentinels turn
  into a replica of the new master. Training finishes, nothing acknowledged is lost, nothing is
  trained twice.
- two replicas, and the lease holder's connections to the new master cut again and again while
  the failover settles: the other replica acknowledges the writes, nobody restarts anything, the
  learner keeps its lease (replicated with the writes it fences) and the run finishes the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import redis
from harness import (
    dropped_duplicates,
    generator_fields,
    ledger_audit,
    start,
    steps_done,
    stop_all,
    trained_ids,
    wait_until,
    write_accounting,
    write_config,
)

from tests.helpers.sentinel_cluster import SERVICE, SentinelCluster

STEPS, B = 6, 4
CUT_S = 3.0  # how long the learner's connections are cut after the promotion


def _cut_connections(pid: int, node, until: float) -> int:
    """Kill, on `node`, every connection of process `pid` and its children, until `until`
    (time.monotonic()); returns how many were cut."""
    cut = 0
    admin = node.client()
    while time.monotonic() < until:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            for p in procs:
                for c in p.net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == node.port and c.status == "ESTABLISHED":
                        cut += int(admin.client_kill_filter(addr=f"127.0.0.1:{c.laddr.port}") or 0)
        except (psutil.Error, redis.RedisError):
            pass
        time.sleep(0.1)
    return cut


def _status_json(config) -> str:
    args = [sys.executable, "-m", "rollflash.rollctl.cli", "status", "--json", "--config"]
    return subprocess.run(
        [*args, str(config)], capture_output=True, text=True, timeout=60, check=True
    ).stdout


@pytest.mark.parametrize("replicas, cut_lease_holder", [(1, False), (2, True)])
def test_master_killed_mid_run(tmp_path, run_id, fault_report, replicas, cut_lease_holder):
    cluster = SentinelCluster(tmp_path / "sentinel", replicas=replicas).start()
    sentinel = {"hosts": cluster.hosts, "service": SERVICE}
    config = write_config(tmp_path, cluster.url(), run_id, STEPS, B, redis={"sentinel": sentinel})
    run_dir = tmp_path / "run"
    gens = [start("start-generator", config, "--id", f"gen-{i}") for i in range(2)]
    learner = start("start-learner", config)
    cut = 0
    try:
        wait_until(lambda: steps_done(run_dir) >= 2, 180, "two learner steps")
        cluster.master.kill()
        new = cluster.wait_promoted()
        if replicas == 1:
            # the supervisor's restart: an empty node that joins the master the Sentinels name
            # (as deploy/k8s's configure.sh does); restarted as a bare master it would answer
            # as one, empty, until the Sentinels turn it, and a client reaching it then finds
            # the run gone
            cluster.master.start("--replicaof", "127.0.0.1", str(new.port))
        if cut_lease_holder:
            cut = _cut_connections(learner.pid, new, time.monotonic() + CUT_S)
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
        for g in gens:
            assert g.wait(timeout=60) == 0, g.stderr_text()[-3000:]
        r = new.client()
        trained = trained_ids(run_dir)
        writes = write_accounting(r, run_id)
        audit = ledger_audit(r, run_id, run_dir)
        lost_prompts = int(r.hget(f"rl:{run_id}:run", "redis_lost_prompts") or 0)
        by_learner = int(r.hget(f"rl:{run_id}:run", "redis_lost_trajectory_writes") or 0)
        by_writers = sum(int(g["redis_lost"]) for g in generator_fields(r, run_id).values())
        status = json.loads(_status_json(config))  # through the Sentinels, like the processes
    finally:
        stop_all([learner, *gens])
        cluster.stop()
    assert len(trained) == len(set(trained)) == STEPS * B  # every step complete, none twice
    # every write a generator was answered for is on the promoted replica: acknowledged - stored
    # <= 0 (an indeterminate re-send may add one, never remove one)
    assert writes["lost_at_least"] == 0, writes
    # and neither side found a write Redis forgot
    assert lost_prompts == 0 and by_learner == 0 and by_writers == 0
    assert audit["unrecorded"] == 0 and audit["multiple"] == [], audit
    assert status["run"] == run_id and status["streams"], status
    if cut_lease_holder:
        assert cut > 0, "no connection of the learner was cut: nothing was tested"
    fault_report(
        f"redis master kill -9, Sentinel, {replicas} replica(s)"
        + (", lease holder cut" if cut_lease_holder else ""),
        injected=1 + cut,
        recovered=1,
        lost=writes["lost_at_least"] + lost_prompts,
        reported=max(by_learner, by_writers) + lost_prompts,
        by_learner=by_learner,
        by_writers=by_writers,
        duplicated=len(trained) - len(set(trained)),
        dropped_duplicates=dropped_duplicates(run_dir),
        indeterminate=writes["indeterminate"],
        unrecorded=audit["unrecorded"],
    )
