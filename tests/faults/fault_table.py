"""The fault report's table, shared by tests/faults/conftest.py and scripts/fault_report.py
(columns: docs/faults.md)."""

COLUMNS = (
    "injected",
    "lost",
    "indeterminate",
    "recovered",
    "reported",
    "by_learner",
    "by_writers",
    "duplicated",
    "dropped_duplicates",
    "unrecorded",
)


def format_table(rows: list[dict]) -> str:
    width = max([len("scenario")] + [len(r["scenario"]) for r in rows])
    lines = [f"{'scenario':<{width}}  " + "  ".join(f"{c:>{max(9, len(c))}}" for c in COLUMNS)]
    for r in rows:
        lines.append(
            f"{r['scenario']:<{width}}  "
            + "  ".join(f"{str(r.get(c, '-')):>{max(9, len(c))}}" for c in COLUMNS)
        )
    return "\n".join(lines)
