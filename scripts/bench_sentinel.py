"""What waiting for a replica costs: the same writes through a plain client and through the
Sentinel client (broker/connect/sentinel.py: WAIT 1 after each write), on one master with one replica
and three Sentinels on loopback, measured in the same run.

Writes: a generator's trajectory (XADD of a `payload_bytes` entry) and a small hash write (HSET,
the shape of a heartbeat or the learner's ledger state). Prints one JSON line: microseconds per
write each way (medians of `rounds` interleaved rounds), the added cost per write, and that cost
times `writes_per_step`, the writes one learner step makes (docs/faults.md counts them).

    python scripts/bench_sentinel.py [--writes 2000] [--payload-bytes 4000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflash.broker.connect.sentinel import master_client  # noqa: E402
from tests.helpers.sentinel_cluster import SERVICE, SentinelCluster  # noqa: E402


def _per_write_us(client, writes: int, payload: bytes) -> dict[str, float]:
    out = {}
    for name, write in {
        "xadd": lambda i: client.xadd("bench:traj", {"traj_id": i, "payload": payload}),
        "hset": lambda i: client.hset("bench:gen", mapping={"published": i, "ts": time.time()}),
    }.items():
        write(0)  # connect
        t0 = time.perf_counter()
        for i in range(writes):
            write(i)
        out[name] = (time.perf_counter() - t0) / writes * 1e6
    client.delete("bench:traj", "bench:gen")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--payload-bytes", type=int, default=4000)
    p.add_argument("--writes-per-step", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    payload = b"x" * a.payload_bytes
    with tempfile.TemporaryDirectory() as d:
        cluster = SentinelCluster(Path(d), replicas=1).start()
        try:
            clients = {
                "plain": cluster.master.client(),
                "wait": master_client(cluster.url(), cluster.hosts, SERVICE, 1),
            }
            rounds: dict[str, list[dict[str, float]]] = {"plain": [], "wait": []}
            for _ in range(a.rounds):  # interleaved, so that load on the machine hits both
                for name, client in clients.items():
                    rounds[name].append(_per_write_us(client, a.writes, payload))
        finally:
            cluster.stop()
    plain, waited = (
        {k: statistics.median(r[k] for r in rounds[name]) for k in ("xadd", "hset")}
        for name in ("plain", "wait")
    )
    added = {k: waited[k] - plain[k] for k in plain}
    print(
        json.dumps(
            {
                "bench": "sentinel_wait",
                "payload_bytes": a.payload_bytes,
                "plain_us": {k: round(v, 1) for k, v in plain.items()},
                "wait_us": {k: round(v, 1) for k, v in waited.items()},
                "ratio": {k: round(waited[k] / plain[k], 2) for k in plain},
                "added_us_per_write": {k: round(v, 1) for k, v in added.items()},
                "writes_per_step": a.writes_per_step,
                "added_ms_per_step": round(a.writes_per_step * max(added.values()) / 1000, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
