"""Write word problems in GSM8K's format: JSONL rows {"question", "answer"} whose answer is a
worked solution ending in `#### N`, as openai/gsm8k's are. The worked example of docs/tasks.md
("Bring your own task") trains the tiny model on them with the `math` verifier.

    Tom has 3 apples and buys 4 more. How many now?
    3 + 4 = 7
    #### 7

Problems are small on purpose (a CPU-sized model learns them in minutes): one of a few sentence
templates (adding or taking away), a name, an object, and two numbers in [1, --max-number]; a
take-away problem never goes below zero. Every question is distinct; `train.jsonl` and
`test.jsonl` share no question. Deterministic for a seed.

    python scripts/make_word_problems.py --out data/word_problems --train 4000 --test 200
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Max", "Zoe")
THINGS = ("apples", "pens", "books", "coins", "cards", "eggs", "cups", "toys")
# (template, sign): the answer is a + sign * b
TEMPLATES = (
    ("{n} has {a} {t} and buys {b} more. How many now?", 1),
    ("{n} has {a} {t} and finds {b} more. How many now?", 1),
    ("{n} has {a} {t} and gives away {b}. How many are left?", -1),
    ("{n} had {a} {t} and lost {b}. How many are left?", -1),
)


def problem(rng: random.Random, max_number: int) -> dict[str, str]:
    """One row: a question and its GSM8K-style answer ("a + b = c" then "#### c")."""
    template, sign = rng.choice(TEMPLATES)
    a, b = rng.randint(1, max_number), rng.randint(1, max_number)
    if sign < 0 and b > a:
        a, b = b, a
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    c = a + sign * b
    op = "+" if sign > 0 else "-"
    return {
        "question": template.format(n=n, a=a, b=b, t=t),
        "answer": f"{a} {op} {b} = {c}\n#### {c}",
    }


def make_rows(n: int, seed: int, max_number: int) -> list[dict[str, str]]:
    """`n` rows with distinct questions (ValueError if fewer exist)."""
    rng, seen, rows = random.Random(seed), set(), []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"fewer than {n} distinct problems with --max-number {max_number}")
        row = problem(rng, max_number)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def write_splits(out: Path, train: int, test: int, seed: int, max_number: int) -> dict[str, int]:
    """`out/train.jsonl` and `out/test.jsonl`; returns the row counts."""
    rows = make_rows(train + test, seed, max_number)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test", rows[:test]), ("train", rows[test:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return {"train": train, "test": test}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    p.add_argument("--train", type=int, default=4000, help="train rows")
    p.add_argument("--test", type=int, default=200, help="held-out rows")
    p.add_argument("--max-number", type=int, default=9, help="numbers are in [1, this]")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    counts = write_splits(Path(args.out), args.train, args.test, args.seed, args.max_number)
    print(json.dumps({"out": args.out, **counts}), flush=True)


if __name__ == "__main__":
    main()
