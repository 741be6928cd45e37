"""The embedded Redis of `rollctl run` across a stop (broker/connect/redis_server.py `snapshot`): a clean
stop keeps the data for the next start and for `rollctl status` / `inspect` / `redis-cli`, which
read it through a server of their own (rollctl/find.py); a crash leaves no stale snapshot."""

import redis

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.connect.redis_server import EmbeddedRedis
from rollflash.rollctl.find import record_embedded, run_redis


def test_a_clean_stop_keeps_the_data_and_the_next_start_takes_it(tmp_path):
    directory = tmp_path / "run" / "redis"
    server = EmbeddedRedis(directory, snapshot=True).start()
    redis.Redis(unix_socket_path=str(server.socket)).set("rl:r:run", "kept")
    server.stop()
    assert (directory / "dump.rdb").is_file()

    again = EmbeddedRedis(directory, snapshot=True).start()
    assert redis.Redis(unix_socket_path=str(again.socket)).get("rl:r:run") == b"kept"
    assert not (directory / "dump.rdb").exists()  # held in memory: a crash leaves none behind
    again.kill()
    assert not (directory / "dump.rdb").exists()
    empty = EmbeddedRedis(directory, snapshot=True).start()
    assert redis.Redis(unix_socket_path=str(empty.socket)).get("rl:r:run") is None
    empty.stop()


def test_a_stopped_runs_redis_is_read_from_its_snapshot_and_left_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    server = EmbeddedRedis(run_dir / "redis", snapshot=True).start()
    record_embedded(run_dir, server.url)
    redis.Redis(unix_socket_path=str(server.socket)).set("rl:r:run", "done")
    server.stop()
    cfg = config_from_dict({"run": {"run_id": "r", "run_dir": str(run_dir)}})  # no redis.url
    with run_redis(cfg) as url:
        assert url != server.url  # a private server on the snapshot
        r = redis.Redis.from_url(url)
        assert r.get("rl:r:run") == b"done"
        r.set("rl:r:run", "changed")
    with run_redis(cfg) as url:
        assert redis.Redis.from_url(url).get("rl:r:run") == b"done"  # nothing written back
    live = EmbeddedRedis(run_dir / "redis", snapshot=True).start()  # the run again: read live
    cfg.redis.url = live.url
    with run_redis(cfg) as url:
        assert url == live.url
    live.stop()
