"""A generator's tokens/s with and without code scoring, on configs/mixture.yaml's batches.

One process does what a generator does with each batch of `rollout_batch_size` prompts of the
mixture (half addition, half one-liners): sample them with the HF engine at each domain's
response limit (generators/rollout.py `generate_limited`), then score the groups with the
mixture's rewards: the one-liners in the bubblewrap sandbox (`reward.code`, `max_workers`
threads; a batch's identical programs run once), the sums by their rule. A generator does the two
one after the other, so in the same run and on the same batches
- `without`: response tokens / generation time (code scoring skipped);
- `with`: response tokens / (generation + scoring time).
Their ratio is the number to read; absolute rates depend on the machine and its load. Needs the
warm-started model (`make mixture-model`): a random model writes no programs worth running.

Then the cost of a sample's tests, `--calls` samples of each kind, alternating, with the same
limits (`reward.code` defaults), per test: `python`, two assert-style tests through the verifier
(envs/code_judge.py: one judge's sandbox for the sample, a fresh program's sandbox per test, the
calls relayed between them); `stdio`, two stdin/stdout tests through the verifier (one sandbox
each); `one_process`, the same assert tests each run with the program in one sandboxed
interpreter (what a harness that shares the program's interpreter costs, as the verifier's did
before the judge moved out; it could be forged). Prints one JSON line.

    python scripts/bench_code_scoring.py [--model models/tiny-mixture] [--batches 6] [--calls 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.broker.config.config import load_config  # noqa: E402
from rollflash.broker.wire.schema import PromptWork  # noqa: E402
from rollflash.envs import Item, task_from_config  # noqa: E402
from rollflash.envs.code_verifier import (  # noqa: E402
    CodeLimits,
    extract_program,
    parse_tests,
    run_tests,
)
from rollflash.envs.sandbox import Sandbox  # noqa: E402
from rollflash.generators.engine import make_engine  # noqa: E402
from rollflash.generators.rollout import generate_limited  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402

PROGRAM = "def add(a, b):\n    return a + b"
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
STDIO_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"
STDIO = [{"input": "2 3\n", "output": "5\n"}, {"input": "-1 1\n", "output": "0\n"}]


def verifier_cost(calls: int) -> dict[str, float]:
    """Milliseconds per test of each way to run a sample's two tests, alternating."""
    limits = CodeLimits()

    def one_process() -> None:
        for test in TESTS:
            box = Sandbox(limits.sandbox(limits.time_s))
            assert box.run(f"{PROGRAM}\n{test}\n").ok
            box.close()

    runs = {
        "python": lambda: run_tests(PROGRAM, parse_tests(TESTS), limits).passed == 2,
        "stdio": lambda: run_tests(STDIO_PROGRAM, parse_tests(STDIO), limits).passed == 2,
        "one_process": lambda: one_process() is None,
    }
    spent = dict.fromkeys(runs, 0.0)
    for k in range(calls + 1):  # sample 0 of each warms up
        for name, fn in runs.items():
            started = time.perf_counter()
            assert fn(), name
            if k:
                spent[name] += time.perf_counter() - started
    per_test = {k: 1000 * v / (calls * len(TESTS)) for k, v in spent.items()}
    return {
        **{f"test_ms_{k}": round(v, 1) for k, v in per_test.items()},
        "python_over_one_process": round(per_test["python"] / per_test["one_process"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-mixture")
    parser.add_argument("--config", default=str(ROOT / "configs" / "mixture.yaml"))
    parser.add_argument("--batches", type=int, default=6, help="measured batches (after one)")
    parser.add_argument("--calls", type=int, default=30, help="samples of each kind of test")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"model.path={args.model}"])
    torch.set_num_threads(cfg.run.torch_threads)
    task = task_from_config(cfg)
    engine = make_engine(cfg, cfg.run.seed)
    params = SamplingParams.for_rollout(cfg.rollout, cfg.rollout.num_return_sequences)
    items = task.train_items(cfg.run.seed)
    spent = {"generate": 0.0, "score": 0.0}
    tokens = samples = programs = 0
    for batch in range(args.batches + 1):  # batch 0 warms up the engine and the sandbox
        chunk = list(itertools.islice(items, cfg.trainer.rollout_batch_size))
        works = [
            PromptWork(it.id, f"g{i}", params.n, 0, dataclasses.asdict(it))
            for i, it in enumerate(chunk)
        ]
        started = time.perf_counter()
        groups = generate_limited(engine, task, works, params)
        generated = time.perf_counter()
        texts = [[s.text for s in g] for g in groups]
        task.score_groups([Item(**w.item) for w in works], texts)
        scored = time.perf_counter()
        if batch == 0:
            continue
        spent["generate"] += generated - started
        spent["score"] += scored - generated
        tokens += sum(len(s.response_ids) for g in groups for s in g)
        code = [(it.id, t) for it, g in zip(chunk, texts) for t in g if it.id.startswith("code/")]
        samples += len(code)
        programs += len({(i, extract_program(t)) for i, t in code})
    without = tokens / spent["generate"]
    with_code = tokens / (spent["generate"] + spent["score"])
    print(
        json.dumps(
            {
                "batches": args.batches,
                "prompts_per_batch": cfg.trainer.rollout_batch_size,
                "response_tokens": tokens,
                "code_samples": samples,
                "code_programs_run": programs,
                "max_workers": cfg.reward.code.max_workers,
                "generate_s": round(spent["generate"], 2),
                "score_s": round(spent["score"], 2),
                "tok_s_without_code_scoring": round(without, 1),
                "tok_s_with_code_scoring": round(with_code, 1),
                "with_over_without": round(with_code / without, 3),
                **verifier_cost(args.calls),
            }
        )
    )


if __name__ == "__main__":
    main()
