"""The fault suite's report: each scenario records what was injected and what happened, measured
from its own run (Redis contents, the learner's ledger, generator heartbeats); the table is printed
at the end of the session, and appended as JSON lines to $ROLLFLASH_FAULT_REPORT when it is set
(scripts/fault_report.py runs the suite that way). Columns (docs/faults.md):
injected, recovered, lost (acknowledged trajectories / prompts Redis no longer holds and nobody
re-created), indeterminate (writes whose reply a fault took: stored once, twice or not at all),
reported (what the system itself counted and reported), by_learner / by_writers (forgotten
trajectory writes counted by the learner / by their writers: overlapping counts of the same
events, never added up), duplicated (trajectories trained more than once), dropped_duplicates
(duplicates the learner dropped by traj_id), unrecorded (entries the learner acknowledged
without a ledger record: always 0).
"""

from __future__ import annotations

import json
import os

import pytest
from fault_table import format_table

_RECORDS: list[dict] = []


@pytest.fixture
def fault_report():
    def record(scenario: str, **counts) -> None:
        row = {"scenario": scenario, **counts}
        _RECORDS.append(row)
        path = os.environ.get("ROLLFLASH_FAULT_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record


def pytest_terminal_summary(terminalreporter):
    if _RECORDS:
        terminalreporter.section("fault report")
        terminalreporter.write_line(format_table(_RECORDS))
