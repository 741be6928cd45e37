"""Run the fault suite and print what each scenario injected and what happened.

    .venv/bin/python scripts/fault_report.py            # runs tests/faults (about 4 minutes)
    .venv/bin/python scripts/fault_report.py --from report.jsonl   # print a saved report

Every number comes from the runs themselves (tests/faults/conftest.py: Redis contents, the
learner's ledger and metrics, generator heartbeats, the AOF tail a simulated power cut erased).
Columns (docs/faults.md): injected, lost (acknowledged writes Redis no longer had), recovered,
reported (what the system itself counted), by_learner / by_writers (forgotten trajectory writes
counted by the learner and by the generators that wrote them: the same events seen from two
sides, so `reported` takes the larger, never the sum), duplicated (trained twice),
dropped_duplicates.
Exit status: pytest's, so a failing scenario fails the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
from fault_table import format_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="any other argument goes to pytest, e.g. -k redis",
    )
    ap.add_argument("--from", dest="source", type=Path, help="print this JSONL report instead")
    args, pytest_args = ap.parse_known_args()  # in order, so `-k redis` needs no `--`
    code = 0
    if args.source:
        path = args.source
    else:
        path = Path(tempfile.mkdtemp(prefix="faults-")) / "report.jsonl"
        env = {**os.environ, "ROLLFLASH_FAULT_REPORT": str(path)}
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/faults",
                "-q",
                "-p",
                "no:cacheprovider",
                *pytest_args,
            ],
            cwd=ROOT,
            env=env,
        ).returncode
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    print(format_table(rows) if rows else "no scenario recorded a result")
    if not args.source:
        print(f"(report: {path}; pytest exit status {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
