"""Redis memory per 1,000 trajectories: a real sim run (`rollctl start-learner` and one
`start-generator`, embedded redis-server) writes trajectories of about `--tokens` tokens; one of
its entries is then copied 1,000 times into an empty redis-server, whose `used_memory` grows by
what 1,000 such entries in flight cost. Prints one JSON line per token count.

    python scripts/bench_redis_memory.py [--tokens 64 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "faults")]

from harness import start, stop_all, streams, write_config  # noqa: E402

from rollflash.broker.connect.redis_server import EmbeddedRedis  # noqa: E402


def one_entry(tmp: Path, tokens: int) -> dict[bytes, bytes]:
    """A trajectory entry of a short real run whose responses are about `tokens` long."""
    server = EmbeddedRedis(tmp / "run-redis").start()
    run_id = f"m{uuid.uuid4().hex[:8]}"
    config = write_config(
        tmp, server.url, run_id, 2, 2,
        rollout={"max_new_tokens": tokens},
        sim={"length_median": tokens, "length_sigma": 0.01},
        redis={"keep_acknowledged_s": 600},
    )  # fmt: skip
    procs = [start("start-generator", config, "--id", "gen-0"), start("start-learner", config)]
    try:
        if procs[1].wait(timeout=600) != 0:
            raise SystemExit(procs[1].stderr_text()[-2000:])
        r = redis.Redis.from_url(server.url)
        (stream,) = streams(r, run_id)
        return r.xrange(stream, count=1)[0][1]
    finally:
        stop_all(procs)
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    a = p.parse_args()
    for tokens in a.tokens:
        with tempfile.TemporaryDirectory() as d:
            fields = one_entry(Path(d), tokens)
            with EmbeddedRedis(Path(d) / "probe") as probe:
                r = redis.Redis.from_url(probe.url)
                before = r.info("memory")["used_memory"]
                for _ in range(1000):
                    r.xadd("traj", fields)
                used = r.info("memory")["used_memory"] - before
        entry = sum(len(k) + len(v) for k, v in fields.items())
        row = {"bench": "redis_memory", "tokens": tokens, "entry_bytes": entry}
        print(json.dumps({**row, "used_memory_per_1000_mib": round(used / 2**20, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
