"""The learner's held-out evaluation between steps: which items, on which ranks, with which limits.

    evaluator = Evaluator(cfg, dist, task, heldout, policy, model, tokenizer, sink)
    accuracy  = evaluator.greedy(step)    # greedy accuracy; a mixture's per domain in `by_domain`
    sampled   = evaluator.sampled(step)   # eval.n_samples > 0: mean reward, pass@1, pass@k

Greedy accuracy runs on rank 0, or with sharded weights (FSDP) on every rank, each generating for
its share of the items (learner/evaluate.py); an agent program's episodes run on rank 0
(learner/agent_eval.py: the config refuses agents with fsdp). A mixture is evaluated per domain,
each with its own response limit (envs/mixture.py). Rank 0 logs every generation (the sink's
`eval_generations.jsonl`). The simulated policy is not evaluated (0.0, no sampled figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollflash.broker.config import Config
from rollflash.envs import Item, Task, is_multi_turn
from rollflash.learner.agent_eval import agent_success
from rollflash.learner.dist import Dist, is_sharded
from rollflash.learner.evaluate import heldout_accuracy, sampled_eval
from rollflash.learner.metrics import MetricsSink
from rollflash.learner.simulated import SimulatedPolicy


@dataclass
class Evaluator:
    cfg: Config
    dist: Dist
    task: Task
    items: list[Item]  # the held-out items evaluated (the first eval.size)
    policy: torch.nn.Module  # the Hugging Face model, unwrapped
    model: torch.nn.Module  # what the ranks train: sharded with FSDP
    tokenizer: Any
    sink: MetricsSink | None  # rank 0 only
    by_domain: dict[str, float] = field(default_factory=dict)  # a mixture's last evaluation

    @property
    def simulated(self) -> bool:
        return isinstance(self.policy, SimulatedPolicy)

    def greedy(self, step: int) -> float:
        """Greedy held-out accuracy at learner `step` (every rank calls it; those that take no
        part return 0.0); a mixture's per-domain accuracies go to `by_domain`."""
        sharded = is_sharded(self.model)
        if self.simulated or not (self.dist.is_main or sharded):
            return 0.0
        e, rows = self.cfg.eval, list[dict]()
        limit = e.max_new_tokens or self.cfg.rollout.max_new_tokens
        domains = domain_items(self.task, self.items, limit) or {"": (self.items, limit)}
        correct = 0.0
        for name, (items, domain_limit) in domains.items():
            if self.cfg.rollout.agent:
                acc = agent_success(
                    self.policy, self.tokenizer, self.cfg, items, domain_limit, e.threshold, rows
                )
            else:
                acc = heldout_accuracy(
                    self.policy,
                    self.tokenizer,
                    self.task,
                    items,
                    domain_limit,
                    threshold=e.threshold,
                    record=rows,
                    dist=self.dist if sharded else None,
                )
            if name:
                self.by_domain[f"eval/{name}/heldout_acc"] = acc
            correct += acc * len(items)
        if self.sink is not None:
            self.sink.log_eval_generations(step, rows)
        return correct / max(len(self.items), 1)

    def sampled(self, step: int) -> dict[str, float]:
        """`eval.n_samples` > 0: mean reward, pass@1 and pass@k on the held-out items (rank 0),
        sampled under the seed `run.seed + step`."""
        e = self.cfg.eval
        if not e.n_samples or self.simulated or not self.dist.is_main:
            return {}
        if is_multi_turn(self.task) or self.cfg.rollout.agent or is_sharded(self.model):
            return {}  # episodes have their own success rate; sharded weights need every rank
        rows: list[dict] = []
        out = sampled_eval(
            self.policy,
            self.tokenizer,
            self.task,
            self.items,
            e.n_samples,
            e.temperature,
            e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            e.threshold,
            seed=self.cfg.run.seed + step,
            record=rows,
        )
        if self.sink is not None:
            self.sink.log_eval_generations(step, rows)
        return out


def domain_items(
    task: Task, items: list[Item], limit: int
) -> dict[str, tuple[list[Item], int]] | None:
    """A mixture's held-out items by domain with each domain's response limit (envs/mixture.py;
    `limit` where the domain has none); None for any other task."""
    if not hasattr(task, "components"):
        return None
    out: dict[str, tuple[list[Item], int]] = {}
    for item in items:
        component, _ = task.component_of(item)  # type: ignore[attr-defined]
        out.setdefault(component.name, ([], component.max_new_tokens or limit))[0].append(item)
    return out
