"""Python tool calls per second: the bubblewrap sandbox against a bare interpreter start.

Runs, alternately, `--calls` times each (after one warm-up each):
- `sandbox`: `Sandbox.run(CODE)` (envs/sandbox.py: bwrap, namespaces, seccomp, rlimits, the
  scratch archive in and out);
- `bare`: `python -I -S -c CODE` in a subprocess, the floor any process-per-call tool pays.
The ratio is the number to read: absolute rates depend on the machine and its load. Prints one
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

from rollflash.envs.sandbox import Sandbox  # noqa: E402

CODE = "print(sum(i * i for i in range(1000)))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    box = Sandbox()

    def sandboxed() -> None:
        assert box.run(CODE).output == "332833500\n"

    def bare() -> None:
        subprocess.run([sys.executable, "-I", "-S", "-c", CODE], check=True, capture_output=True)

    spent = {"sandbox": 0.0, "bare": 0.0}
    sandboxed(), bare()  # warm-up
    for _ in range(args.calls):
        for name, fn in (("sandbox", sandboxed), ("bare", bare)):
            started = time.perf_counter()
            fn()
            spent[name] += time.perf_counter() - started
    box.close()
    rates = {f"{k}_calls_per_s": round(args.calls / v, 1) for k, v in spent.items()}
    print(json.dumps({**rates, "sandbox_over_bare": round(spent["bare"] / spent["sandbox"], 2)}))


if __name__ == "__main__":
    main()
