"""Held-out evaluation with sharded weights: two FSDP gloo ranks (tests/integration/eval_worker.py)
whose greedy generations stop at different lengths and who make different numbers of `generate`
calls finish, and their accuracy and records equal one process's over the same items."""

import json
from pathlib import Path

from rollflash.learner.process.dist import Dist
from tests.helpers.ranks import run_ranks
from tests.integration.eval_worker import evaluate

WORKER = Path(__file__).with_name("eval_worker.py")
MAX_NEW = 12


def test_two_sharded_ranks_with_different_lengths_evaluate_as_one(tiny_model_dir, tmp_path):
    probe = evaluate(str(tiny_model_dir), list(range(16)), MAX_NEW, Dist())["rows"]
    lengths = [len(r["response"]) for r in probe]
    short = [i for i, n in enumerate(lengths) if n == min(lengths)]
    long = [i for i, n in enumerate(lengths) if n == max(lengths)]
    assert len(short) >= 3 and len(long) >= 2 and min(lengths) < max(lengths)
    # item i goes to rank i mod 2: rank 0 gets the 3 short answers (2 generate calls of 2
    # prompts), rank 1 the 2 long ones (1 call; it generates once more for nothing), so rank 0's
    # sequences finish before rank 1's in every call they share
    indices = [short[0], long[0], short[1], long[1], short[2]]
    one = evaluate(str(tiny_model_dir), indices, MAX_NEW, Dist())
    out = tmp_path / "two.json"
    run_ranks(2, WORKER, str(tiny_model_dir), str(out), json.dumps(indices), str(MAX_NEW))
    two = json.loads(out.read_text())
    assert two == one
    assert [r["response"] for r in two["rows"]] == [probe[i]["response"] for i in indices]
