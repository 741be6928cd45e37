"""Python tool calls per second: the bubblewrap sandbox against a bare interpreter start.

Runs, alternately, `--calls` times each (after one warm-up each):
- `sandbox`: `Sandbox.run(CODE)` (envs/sandbox.py: bwrap, namespaces, seccomp, rlimits, the
  scratch archive in and out) with this host's per-call bound (`bound`: a cgroup per call where
  the host delegates one, envs/_cgroup.py);
- `rlimits`: the same with ROLLFLASH_SANDBOX_CGROUP=off, the bound of a host without cgroup
  delegation (one process per call, no cgroup to make and remove);
- `bare`: `python -I -S -c CODE` in a subprocess, the floor any process-per-call tool pays.
The ratios are the numbers to read: absolute rates depend on the machine and its load. Prints one
JSON line.

    python scripts/bench_sandbox.py [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflash.envs import _exchange  # noqa: E402
from rollflash.envs._cgroup import CallBound, per_call_bound  # noqa: E402
from rollflash.envs.sandbox import Sandbox  # noqa: E402

CODE = "print(sum(i * i for i in range(1000)))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    host = per_call_bound()
    without = CallBound("rlimits", why="ROLLFLASH_SANDBOX_CGROUP=off")
    box = Sandbox()

    def sandboxed(cgroup: bool) -> None:
        # what per_call_bound() answers on this host, and with ROLLFLASH_SANDBOX_CGROUP=off
        _exchange.per_call_bound = (lambda: host) if cgroup else (lambda: without)
        assert box.run(CODE).output == "332833500\n"

    def bare() -> None:
        subprocess.run([sys.executable, "-I", "-S", "-c", CODE], check=True, capture_output=True)

    runs = {"sandbox": lambda: sandboxed(True), "rlimits": lambda: sandboxed(False), "bare": bare}
    spent = dict.fromkeys(runs, 0.0)
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(args.calls):
        for name, fn in runs.items():
            started = time.perf_counter()
            fn()
            spent[name] += time.perf_counter() - started
    box.close()
    rates = {f"{k}_calls_per_s": round(args.calls / v, 1) for k, v in spent.items()}
    print(
        json.dumps(
            {
                "bound": host.kind,
                **rates,
                "sandbox_over_bare": round(spent["bare"] / spent["sandbox"], 2),
                "sandbox_over_rlimits": round(spent["rlimits"] / spent["sandbox"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
