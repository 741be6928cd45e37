"""Held-out evaluation of an agent program (`rollout.agent`): the share of held-out items whose
episode reward reaches `eval.threshold`, measured by the learner on its own weights.

The episodes run as on a generator (envs/agent_host.py: the same endpoint, records and limits),
their calls answered by the learner's model with greedy decoding whatever temperature they ask
for, at most BATCH episodes at a time. An episode that fails (raises, times out, returns a bad
value) counts as unsolved. Each episode is one row of `record` ({"eval": "agent", "id",
"sample": 0, "prompt", "response": its final chain's texts joined with " | ", "reward",
"pass"}). Runs on rank 0 between steps, like every evaluation (learner/evaluation/eval_generate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollflash.envs import Item
from rollflash.envs.agent import Codec, load_agent
from rollflash.envs.agent_host import AgentHost, Run
from rollflash.envs.agent_protocol import Limits
from rollflash.envs.chat import PromptFormatter
from rollflash.learner.evaluation.eval_generate import greedy_ids, until_eos

BATCH = 64  # episodes in flight


@dataclass
class _Greedy:
    response_ids: list[int]
    logprobs: list[float]
    token_versions: list[int] | None = None


@torch.no_grad()
def agent_success(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: Any,
    items: list[Item],
    max_new_tokens: int,
    threshold: float,
    record: list[dict] | None = None,
) -> float:
    """Share of `items` whose greedy episode scores at least `threshold` (module docstring)."""
    model.eval()
    rollout = cfg.rollout
    template = PromptFormatter(tokenizer, cfg.model.chat_template).template
    codec = Codec(tokenizer, template, getattr(model.config, "max_position_embeddings", None))
    limits = Limits.of(rollout, max_new_tokens, greedy=True)
    config: Any = model.config
    host = AgentHost(load_agent(rollout.agent), codec, limits, int(config.vocab_size))

    def generate(prompts: list[list[int]], params: Any) -> list[list[_Greedy]]:
        groups = []
        for row in greedy_ids(model, tokenizer, prompts, params.max_tokens):
            row = until_eos(row, tokenizer.eos_token_id)
            groups.append([_Greedy(row, [0.0] * len(row)) for _ in range(params.n)])
        return groups

    runs: list[Run] = []
    waiting = list(enumerate(items))

    def refill(_: Run | None = None) -> None:
        while waiting and sum(not run.done for run in runs) < BATCH:
            index, item = waiting.pop(0)
            runs.append(host.start(item, index))

    try:
        refill()
        host.serve(lambda: not waiting and all(run.done for run in runs), generate, refill)
    finally:
        host.close()
    return _solved(sorted(runs, key=lambda run: run.key), threshold, record) / max(len(items), 1)


def _solved(runs: list[Run], threshold: float, record: list[dict] | None) -> int:
    """Episodes that reached `threshold` without failing; each one a row of `record`."""
    solved = 0
    for run in runs:
        out, seq = run.outcome, run.record.sequence()
        passed = bool(out is not None and not out.failure.endswith(_FAILED) and
                      out.reward >= threshold)  # fmt: skip
        solved += passed
        if record is not None:
            record.append({
                "eval": "agent", "id": run.item.id, "sample": 0, "prompt": run.item.prompt,
                "response": " | ".join(seq.texts) if seq else "",
                "reward": float(out.reward if out else 0.0), "pass": passed,
            })  # fmt: skip
    return solved


_FAILED = ("error", "timeout", "bad_return")
