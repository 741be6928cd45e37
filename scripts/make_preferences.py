"""Write a synthetic preference set (JSONL of {"prompt", "chosen", "rejected"}) for reward-model
training, labelled offline by a ground-truth property of a task's responses.

Properties (`--property`):
- `correct` (docs/algorithms.md, "RLHF", the worked example): on arithmetic prompts the exact
  answer is chosen over a wrong one: answer + 1 (25%, the error the demo's warm-started policy makes most),
  answer - 1 (10%), answer +- 10 or +- 100 (15%), any other number of 1 to 4 digits (20%) or a
  malformed answer (30%: an extra digit, one digit short, a leading zero, a repeated digit; no
  trailing space: the character tokenizer drops it, so a reward model could not see it). A
  reward model that learns this ranks the task's verifier's way, without seeing the verifier. The
  broad mix matters: RL finds what the reward model never saw. With only near misses and same-length
  numbers, the policy learned to write "0" and "00"; without the
  +-10 / +-100 near misses, it learned to get the tens digit wrong.
- `longer` (a deliberately exploitable preference, for the reward-hacking guard test): the longer
  of two well-formed digit strings is chosen, whatever the answer. RL against a reward model trained
  on it learns to run on to `max_new_tokens`.

Prompts come from the task's train stream (never its held-out set), so RL's held-out evaluation is
on prompts neither the reward model nor the policy saw. Deterministic for a seed.

    python scripts/make_preferences.py --out data/prefs.jsonl --pairs 6000 --task-params '{"ops": ["+"]}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflash.envs import Item, make_task  # noqa: E402


def wrong_answer(item: Item, rng: random.Random) -> str:
    """A response that is not the exact answer, from the mix in the module docstring."""
    answer, text = int(item.answer), item.answer
    u = rng.random()
    if u < 0.25:
        return str(answer + 1)
    if u < 0.35 and answer > 0:
        return str(answer - 1)
    if u < 0.5:  # one other digit off: +-10, +-100
        wrong = answer + rng.choice((-1, 1)) * rng.choice((10, 100))
        if wrong >= 0:
            return str(wrong)
    if u < 0.7:  # any other number of 1 to 4 digits
        while True:
            other = str(rng.randint(0, 10 ** rng.randint(1, 4) - 1))
            if other != text:
                return other
    cases = [
        text + rng.choice("0123456789"),  # an extra digit
        text[:-1] or "0" + text,  # stopped a digit early
        "0" + text,  # a leading zero
        rng.choice("0123456789") * rng.randint(2, 4),
    ]  # a repeated digit
    while True:
        wrong = rng.choice(cases)
        if wrong != text and wrong.strip():
            return wrong


def correct_pair(item: Item, rng: random.Random) -> dict[str, str]:
    return {"prompt": item.prompt, "chosen": item.answer, "rejected": wrong_answer(item, rng)}


def longer_pair(item: Item, rng: random.Random) -> dict[str, str]:
    short_len = rng.randint(1, 2)
    long_len = rng.randint(short_len + 1, 4)
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    return {"prompt": item.prompt, "chosen": digits(long_len), "rejected": digits(short_len)}


PROPERTIES = {"correct": correct_pair, "longer": longer_pair}


def make_pairs(task_name: str, task_params: dict, prop: str, n: int, seed: int) -> list[dict]:
    task = make_task(task_name, task_params)
    rng = random.Random(seed)
    items = task.train_items(seed + 7)  # another stream than the RL run's (run.seed)
    return [PROPERTIES[prop](item, rng) for item in itertools.islice(items, n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSONL file to write (parents created)")
    p.add_argument("--pairs", type=int, default=6000, help="number of preference pairs")
    p.add_argument(
        "--property",
        choices=sorted(PROPERTIES),
        default="correct",
        help="the ground truth that decides which response is chosen",
    )
    p.add_argument("--task", default="arithmetic", help="task name for envs.make_task")
    p.add_argument("--task-params", default='{"ops": ["+"]}', help="JSON dict of task params")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.pairs < 2:
        p.error("--pairs must be at least 2")
    pairs = make_pairs(
        args.task, json.loads(args.task_params), args.property, args.pairs, args.seed
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in pairs))
    print(json.dumps({"out": str(out), "pairs": len(pairs), "property": args.property}))


if __name__ == "__main__":
    main()
