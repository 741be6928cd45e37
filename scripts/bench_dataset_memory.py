"""Peak memory of `task.name: dataset` on a large JSONL file: prints one JSON line.

Writes ROWS GSM8K-like rows, builds the task, draws DRAW items from the train stream (the
first use converts the file to Arrow in the datasets cache), jumps to a position near the end as
a resume does, and reports the process's peak RSS next to the same on a 1,000-row file (run
separately, as `--rows 1000`). The file is never read into memory: rows are memory-mapped.

    python scripts/bench_dataset_memory.py --rows 1000000 --dir /tmp/bench_ds
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import time
from pathlib import Path

from rollflash.envs import make_task, train_stream


def _rss_mb() -> dict[str, float]:
    """Resident memory now: anonymous (the process's own) and file-backed (mapped Arrow pages,
    which the kernel can drop and re-read)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: round(int(fields[k].split()[0]) / 1024, 1) for k in ("RssAnon", "RssFile")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--draw", type=int, default=20_000, help="items read from the train stream")
    p.add_argument("--dir", default="/tmp/bench_dataset")
    args = p.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"rows{args.rows}.jsonl"
    if not path.is_file():
        with path.open("w") as f:
            for i in range(args.rows):
                row = {"question": f"tom has {i} apples and buys 3 more. how many?"}
                f.write(json.dumps({**row, "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}) + "\n")
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    task = make_task(
        "dataset", {"path": str(path), "prompt_key": "question", "cache_dir": str(root / "c")}
    )
    items = sum(1 for _ in itertools.islice(task.train_items(0), args.draw))
    t1 = time.perf_counter()
    resumed = next(train_stream(task, 0, args.rows - 5)).id  # a resume near the end: O(1)
    t2 = time.perf_counter()
    print(json.dumps({
        "rows": args.rows,
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "items_drawn": items,
        "load_and_draw_s": round(t1 - t0, 1),
        "resume_s": round(t2 - t1, 3),
        "resumed_id": resumed,
        "rss_before_mb": round(rss_start, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **_rss_mb(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
