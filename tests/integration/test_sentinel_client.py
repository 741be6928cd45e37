"""Redis behind Sentinel (broker/connect/sentinel.py) against a real master, replica and three Sentinels
(tests/helpers/sentinel_cluster.py): the config's `redis.sentinel` switches where the client
goes and how many replicas a write waits for; a failover is waited out; the lease survives it
and still fences a stale learner; `rollctl acl --apply` reaches every node."""

from __future__ import annotations

import pytest
import redis

from rollflash.broker.channels.lease import LeaseLost, RunLease
from rollflash.broker.config.config import load_config
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from rollflash.broker.connect.redis_io import RunRedis
from rollflash.rollctl.acl import acl_users, apply_users
from tests.helpers.sentinel_cluster import SERVICE, SentinelCluster


@pytest.fixture
def cluster(tmp_path):
    c = SentinelCluster(tmp_path / "sentinel", replicas=1).start()
    yield c
    c.stop()


@pytest.fixture
def cluster2(tmp_path):
    """Two replicas: one is left to acknowledge writes once the other is promoted."""
    c = SentinelCluster(tmp_path / "sentinel", replicas=2).start()
    yield c
    c.stop()


def _config(cluster: SentinelCluster, replicas: int = 1, timeout_s: float = 30):
    return load_config(
        None,
        [
            f"redis.url={cluster.url()}",
            f"redis.connect_timeout_s={timeout_s}",
            f"redis.sentinel.hosts={cluster.hosts}",
            f"redis.sentinel.service={SERVICE}",
            f"redis.sentinel.replicas={replicas}",
        ],
    )


def _connect(cfg):
    return connect(cfg.redis.url, cfg.redis.connect_timeout_s, cfg.redis.sentinel)


def test_sentinel_hosts_name_the_server_and_writes_wait_for_the_replica(cluster):
    cfg = _config(cluster)
    # without Sentinel the URL's own address is used: nothing listens on port 1
    with pytest.raises(BrokerUnavailable, match="127.0.0.1:1"):
        connect(cfg.redis.url, 5.0)
    r = _connect(cfg)
    r.set("k", "v")
    # WAIT returned 1 before `set` did: the replica holds the write the moment it is answered
    assert cluster.replicas[0].client().get("k") == b"v"
    pipe = r.pipeline(transaction=True)
    pipe.incr("n").incr("n")
    assert pipe.execute() == [1, 2]
    assert cluster.replicas[0].client().get("n") == b"2"


def test_a_write_that_no_second_replica_acknowledges_is_refused(cluster):
    # replicas: 2 with one replica up: each try's WAIT gets 1 of 2 and is retried until the
    # connect timeout (2 s) has passed since the first shortfall
    r = _connect(_config(cluster, replicas=2, timeout_s=2))
    with pytest.raises(BrokerUnavailable, match="1 of 2 replicas acknowledged"):
        r.set("k", "v")
    assert r.get("k") == b"v"  # stored on the master, but never counted as written


def test_a_failover_is_waited_out_and_the_lease_survives_and_still_fences(cluster2, run_id):
    cluster = cluster2
    cfg = _config(cluster)
    io = RunRedis(_connect(cfg), run_id)
    lease = RunLease(io, ttl_s=60)
    lease.take()
    lease.execute([("SET", io.keys.prefix + ":x", "1")])
    cluster.master.kill()
    # the next fenced write waits until the Sentinels promoted the replica, then lands there
    lease.execute([("SET", io.keys.prefix + ":x", "2")])
    new = cluster.wait_promoted()
    assert new.client().get(io.keys.prefix + ":x") == b"2"
    # a learner that took the run over through the new master fences the old one out
    other = RunLease(RunRedis(_connect(cfg), run_id), ttl_s=60)
    other.take(take_over=True)
    with pytest.raises(LeaseLost):
        lease.execute([("SET", io.keys.prefix + ":x", "3")])
    assert new.client().get(io.keys.prefix + ":x") == b"2"


def test_a_connection_that_lost_its_socket_reconnects_to_the_new_master(cluster2):
    r = _connect(_config(cluster2, timeout_s=5))
    r.set("k", "v")
    conn = r.connection_pool.get_connection()
    cluster2.master.kill()
    new = cluster2.wait_promoted()
    conn.disconnect()
    # what a command re-sent after a lost reply does: send on the same connection, whose last
    # address is the dead master's; it must ask the Sentinels again (5 s of refusals otherwise)
    conn.send_command("GET", "k")
    assert conn.read_response() == b"v"
    assert conn.port == new.port
    r.connection_pool.release(conn)


def test_acl_users_are_created_on_the_master_and_every_replica(cluster, run_id):
    cfg = _config(cluster)
    users = acl_users(run_id, ["gen-0"], "pw")
    apply_users(cfg, users)
    for node in [cluster.master, *cluster.replicas]:
        assert node.client().acl_getuser(users[0].name) is not None
    # and the generator's user may wait for its writes to be replicated
    gen = redis.Redis("127.0.0.1", cluster.master.port, username=users[0].name, password="pw")
    assert gen.execute_command("WAIT", 1, 100) == 1
