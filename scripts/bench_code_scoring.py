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

Then the cost of one Python (assert-style) test, `--calls` times each, alternating, with the same
limits: `new`, the verifier's harness (envs/code_verifier.py: the test compiled first, the program
imported as a module, a nonce reported after the test) in a sandbox with this host's per-call
bound (a cgroup per call where the host delegates one); `old`, the previous verifier: its
harness (program and test in one namespace, passing on exit status 0, which a program's
sys.exit(0) forged; kept below only for this comparison) in a sandbox without a cgroup per call;
and `old_harness`, that harness with this host's bound, which separates the two costs. Prints one
JSON line.

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

from rollflash.broker.config import load_config  # noqa: E402
from rollflash.broker.schema import PromptWork  # noqa: E402
from rollflash.envs import (  # noqa: E402
    Item,
    sandbox,  # noqa: E402
    task_from_config,
)
from rollflash.envs._cgroup import CallBound, per_call_bound  # noqa: E402
from rollflash.envs.code_verifier import CodeLimits, classify, extract_program, harness  # noqa: E402
from rollflash.envs.sandbox import Sandbox  # noqa: E402
from rollflash.generators.engine import make_engine  # noqa: E402
from rollflash.generators.rollout import generate_limited  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402

PROGRAM = "def add(a, b):\n    return a + b"
TEST = "assert add(2, 3) == 5"


def previous_harness(program: str, test: str) -> str:
    """The harness the verifier used before the nonce, for the comparison only."""
    return (
        f"__program = compile({program!r}, '<program>', 'exec')\n__ns = {{'__name__': '__main__'}}\n"
        f"exec(__program, __ns)\nexec(compile({test!r}, '<test>', 'exec'), __ns)\n"
    )


def verifier_cost(calls: int) -> dict[str, float]:
    """Seconds per Python test of the current verifier and the previous one, alternating."""
    limits = CodeLimits()
    host = per_call_bound()
    without = CallBound("rlimits", why="the previous verifier's sandbox")
    spent = {"new": 0.0, "old": 0.0, "old_harness": 0.0}
    for k in range(calls + 1):  # call 0 of each warms up
        for name in spent:
            sandbox.per_call_bound = (lambda: without) if name == "old" else (lambda: host)
            started = time.perf_counter()
            box = Sandbox(limits.sandbox(limits.time_s))
            if name == "new":
                nonce = f"{k:032x}"
                verdict = classify(box.run(harness(PROGRAM, TEST, nonce)), limits, nonce)
            else:
                verdict = "" if box.run(previous_harness(PROGRAM, TEST)).ok else "failed"
            box.close()
            assert verdict == "", (name, verdict)
            if k:
                spent[name] += time.perf_counter() - started
    sandbox.per_call_bound = per_call_bound
    return {
        "bound": host.kind,
        **{f"assert_test_ms_{k}": round(1000 * v / calls, 1) for k, v in spent.items()},
        "new_over_old": round(spent["new"] / spent["old"], 3),
        "new_over_old_harness": round(spent["new"] / spent["old_harness"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-mixture")
    parser.add_argument("--config", default=str(ROOT / "configs" / "mixture.yaml"))
    parser.add_argument("--batches", type=int, default=6, help="measured batches (after one)")
    parser.add_argument("--calls", type=int, default=30, help="Python tests per harness")
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
