"""The learner's held-out evaluation between steps: which items, on which ranks, with which limits.

    evaluator = Evaluator(cfg, dist, task, heldout, policy, model, tokenizer, sink)
    accuracy  = evaluator.greedy(step)    # greedy accuracy; a mixture's per domain in `by_domain`
    health    = evaluator.health(step, accuracy)  # the most common answer, warnings (rank 0)
    sampled   = evaluator.sampled(step)   # eval.n_samples > 0: mean reward, pass@1, pass@k

Greedy accuracy runs on rank 0, or with sharded weights (FSDP) on every rank, each generating for
its share of the items (learner/evaluation/eval_generate.py); an agent program's episodes run on rank 0
(learner/evaluation/agent_eval.py: the config refuses agents with fsdp). A mixture is evaluated per domain,
each with its own response limit (envs/mixture.py). Rank 0 logs every generation (the sink's
`eval_generations.jsonl`) and, where responses have a final answer (not episodes nor agent
programs), finds their most common one for the learning-health checks (learner/metrics/health.py). The
simulated policy is not evaluated (0.0, no sampled figures).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from rollflash.broker.config.config import Config
from rollflash.envs import Item, Task, is_multi_turn
from rollflash.learner.evaluation.agent_eval import agent_success
from rollflash.learner.evaluation.eval_generate import heldout_accuracy, sampled_eval
from rollflash.learner.metrics.health import HealthWatch, TopAnswer, threshold_warning, top_answer
from rollflash.learner.metrics.metrics import MetricsSink
from rollflash.learner.models.simulated import SimulatedPolicy
from rollflash.learner.process.dist import Dist, is_sharded

log = logging.getLogger(__name__)


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
    top: TopAnswer | None = None  # the last greedy evaluation's most common answer (rank 0)
    watch: HealthWatch | None = None  # learner/metrics/health.py's warnings (rank 0)

    def __post_init__(self) -> None:
        self.watch = HealthWatch(len(self.items))

    @property
    def simulated(self) -> bool:
        return isinstance(self.policy, SimulatedPolicy)

    def greedy(self, step: int) -> float:
        """Greedy held-out accuracy at learner `step` (every rank calls it; those that take no
        part return 0.0); a mixture's per-domain accuracies go to `by_domain`."""
        sharded = is_sharded(self.model)
        if self.simulated or not (self.dist.is_main or sharded):
            return 0.0
        eval_cfg, rows = self.cfg.eval, list[dict]()
        limit = eval_cfg.max_new_tokens or self.cfg.rollout.max_new_tokens
        domains = domain_items(self.task, self.items, limit) or {"": (self.items, limit)}
        correct = 0.0
        for name, (items, domain_limit) in domains.items():
            if self.cfg.rollout.agent:
                acc = agent_success(
                    self.policy,
                    self.tokenizer,
                    self.cfg,
                    items,
                    domain_limit,
                    eval_cfg.threshold,
                    rows,
                )
            else:
                acc = heldout_accuracy(
                    self.policy,
                    self.tokenizer,
                    self.task,
                    items,
                    domain_limit,
                    threshold=eval_cfg.threshold,
                    record=rows,
                    dist=self.dist if sharded else None,
                )
            if name:
                self.by_domain[f"eval/{name}/heldout_acc"] = acc
            correct += acc * len(items)
        if self.sink is not None:
            self.sink.log_eval_generations(step, rows)
        self.top = self._top_answer(rows)
        return correct / max(len(self.items), 1)

    def _top_answer(self, rows: list[dict]) -> TopAnswer | None:
        """The most common final answer of the greedy `rows` (rank 0; episodes have none)."""
        if not self.dist.is_main or self.cfg.rollout.agent or is_multi_turn(self.task):
            return None
        by_id = {it.id: it for it in self.items}
        greedy = [r for r in rows if r["eval"] == "greedy" and r["id"] in by_id]
        items, responses = [by_id[r["id"]] for r in greedy], [r["response"] for r in greedy]
        return top_answer(self.task, items, responses, self.cfg.eval.threshold)

    def check_threshold(self) -> None:
        """Warn, in one line, when no right answer can reach `eval.threshold` (rank 0;
        learner/metrics/health.py)."""
        if not self.dist.is_main or self.simulated or self.cfg.rollout.agent:
            return
        warning = threshold_warning(self.task, self.items, self.cfg.eval.threshold)
        if warning:
            log.warning("%s", warning)

    def observe_step(self, reward_mean: float) -> None:
        """A learner step's mean reward, for the reward-versus-accuracy check (rank 0)."""
        if self.watch is not None and self.dist.is_main:
            self.watch.step(reward_mean)

    def health(self, step: int, accuracy: float) -> dict[str, float]:
        """The health metrics of the greedy evaluation just made at `step` (learner/metrics/health.py;
        rank 0, empty elsewhere and for the simulated policy)."""
        if self.watch is None or self.simulated or not self.dist.is_main:
            return {}
        return self.watch.evaluated(step, accuracy, self.top)

    def sampled(self, step: int) -> dict[str, float]:
        """`eval.n_samples` > 0: mean reward, pass@1 and pass@k on the held-out items (rank 0),
        sampled under the seed `run.seed + step`."""
        eval_cfg = self.cfg.eval
        if not eval_cfg.n_samples or self.simulated or not self.dist.is_main:
            return {}
        if is_multi_turn(self.task) or self.cfg.rollout.agent or is_sharded(self.model):
            return {}  # episodes have their own success rate; sharded weights need every rank
        rows: list[dict] = []
        out = sampled_eval(
            self.policy,
            self.tokenizer,
            self.task,
            self.items,
            eval_cfg.n_samples,
            eval_cfg.temperature,
            eval_cfg.max_new_tokens or self.cfg.rollout.max_new_tokens,
            eval_cfg.threshold,
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
