"""The run's lease on a real redis-server (broker/channels/lease.py): one holder, named to whoever else
tries; its fenced writes stop once it is taken over or expired; renewal outlives a full Redis."""

import time

import pytest
import redis

from rollflash.broker.channels.lease import LeaseHeld, LeaseLost
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.sides.learner_side import LearnerBroker


def _broker(url, run_id, ttl_s=30.0) -> LearnerBroker:
    return LearnerBroker(connect(url, 5), run_id, 1000, lease_ttl_s=ttl_s)


def test_one_holder_named_to_the_next_and_take_over_fences_the_old_one(redis_url, run_id):
    first, second = _broker(redis_url, run_id), _broker(redis_url, run_id)
    first.take_lease()
    first.ensure_groups()
    with pytest.raises(LeaseHeld, match=r"has a learner already \(host .*, pid \d+, since 20"):
        second.take_lease()
    assert second.lease.token is None  # it holds nothing and wrote nothing
    first.set_run_fields(state="training")
    second.take_lease(take_over=True)  # an operator who knows the first one is dead
    second.set_run_fields(state="taken")
    with pytest.raises(LeaseLost, match="lost the lease of run .*now held by host"):
        first.set_run_fields(state="zombie")  # fenced: not written
    with pytest.raises(LeaseLost):
        first.check_lease()  # what a checkpoint or weight version checks before it appears
    r = redis.Redis.from_url(redis_url)
    assert r.hget(RunKeys(run_id).run, "state") == b"taken"
    first.release()  # not its lease any more: nothing happens
    assert r.exists(RunKeys(run_id).lease)
    second.release()
    assert not r.exists(RunKeys(run_id).lease)
    _broker(redis_url, run_id).take_lease()  # free again


def test_an_expired_lease_is_lost_and_free(redis_url, run_id):
    """redis.lease_ttl_s: a holder that stops renewing (here: never started its keeper) loses
    the run once the TTL has passed; whoever comes next takes it without --take-over."""
    first = _broker(redis_url, run_id, ttl_s=0.3)
    first.lease.take()
    r, key = redis.Redis.from_url(redis_url), RunKeys(run_id).lease
    assert 0 < r.pttl(key) <= 300
    deadline = time.monotonic() + 30
    while r.exists(key) and time.monotonic() < deadline:  # Redis expires it after its TTL
        time.sleep(0.05)
    _broker(redis_url, run_id).take_lease()
    with pytest.raises(LeaseLost):
        first.check_lease()


def test_renewal_works_while_redis_refuses_writes_at_maxmemory(tmp_path, run_id):
    from rollflash.broker.connect.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "r", extra_args=["--maxmemory-policy", "noeviction"]) as s:
        b = _broker(s.url, run_id, ttl_s=600)
        b.take_lease()
        admin = redis.Redis.from_url(s.url)
        admin.config_set("maxmemory", 1)  # every write is refused with OOM
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("probe", "x")
        b.check_lease()  # PEXPIRE only: allowed, so a full Redis cannot expire the lease
        assert admin.pttl(RunKeys(run_id).lease) > 590_000
        admin.config_set("maxmemory", 0)
        b.release()
