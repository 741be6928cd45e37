"""Evaluation writes its generations: every greedy and sampled response of the held-out items
with its reward and verdict, to eval_generations.jsonl and to each tracker."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.envs import make_task
from rollflash.learner.evaluation.eval_generate import heldout_accuracy, sampled_eval
from rollflash.learner.metrics.metrics import MetricsSink


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.tables = []

    def log(self, step, metrics):
        pass

    def log_eval_generations(self, step, rows):
        self.tables.append((step, rows))

    def close(self):
        pass


def test_greedy_and_sampled_generations_are_recorded_and_written(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task("arithmetic", {"ops": ["+"], "heldout_size": 3})
    items = task.heldout_items()
    greedy, sampled = [], []
    acc = heldout_accuracy(model, tokenizer, task, items, 4, threshold=1.0, record=greedy)
    out = sampled_eval(model, tokenizer, task, items, 2, 1.0, 4, threshold=1.0, record=sampled)
    # one greedy row per item, k = 2 sampled rows per item, in item order
    assert [(r["eval"], r["id"], r["sample"]) for r in greedy] == [
        ("greedy", it.id, 0) for it in items
    ]
    assert [(r["id"], r["sample"]) for r in sampled] == [
        (it.id, j) for it in items for j in range(2)
    ]
    by_id = {it.id: it for it in items}
    for r in greedy + sampled:
        # the reward is the task's score of the recorded response; pass is reward >= 1.0
        assert r["reward"] == task.score(by_id[r["id"]], r["response"])
        assert r["pass"] == (r["reward"] >= 1.0)
        assert r["prompt"] == by_id[r["id"]].prompt
    # the rows are the same verdicts as the metrics
    assert acc == sum(r["pass"] for r in greedy) / 3
    assert out["eval/pass@1"] == sum(r["pass"] for r in sampled) / 6

    recorder = _Recorder()
    sink = MetricsSink(tmp_path, tensorboard=False, trackers=[recorder])
    sink.log_eval_generations(0, greedy)
    sink.log_eval_generations(5, sampled)
    sink.log_eval_generations(5, [])  # nothing evaluated: nothing written
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "eval_generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, **r} for r in greedy] + [{"step": 5, **r} for r in sampled]
    assert [(step, len(rows)) for step, rows in recorder.tables] == [(0, 3), (5, 6)]
    assert recorder.tables[1][1][0] == {"step": 5, **sampled[0]}
