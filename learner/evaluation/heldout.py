"""Held-out evaluations between learner steps (learner/evaluation/evaluator.py runs them), and the version
`eval.keep_best` keeps (learner/evaluation/best.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflash.learner.rank import Learner


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation of the version of learner step `step`: greedy accuracy, a mixture's
    accuracy per domain (`eval/<domain>/heldout_acc`) and the sampled metrics (`eval.n_samples`)."""

    step: int
    accuracy: float
    health: dict[str, float]  # learner/metrics/health.py: the most common answer's share, warnings
    by_domain: dict[str, float]
    sampled: dict[str, float]


def evaluate(ln: Learner) -> Evaluation:
    """Evaluate the current version, offer it to `eval.keep_best` and check learning health."""
    step = ln.state.step
    accuracy = ln.evaluator.greedy(step)
    keep_if_best(ln, accuracy)
    health = ln.evaluator.health(step, accuracy)
    by_domain = dict(ln.evaluator.by_domain)
    return Evaluation(step, accuracy, health, by_domain, ln.evaluator.sampled(step))


def keep_if_best(ln: Learner, accuracy: float) -> None:
    """Offer the version just evaluated (the current one) to `eval.keep_best` (rank 0)."""
    best = ln.best
    if best is None or ln.publisher is None:  # None too for the simulated policy
        return
    if best.accuracy is not None and accuracy <= best.accuracy:
        return
    ln.publisher.wait()  # the version is on disk, manifest last, before it is linked
    best.offer(ln.publisher.store, ln.state.version, ln.state.step, accuracy)


def best_fields(ln: Learner) -> dict[str, Any]:
    """The summary's record of the kept best version (rank 0 with eval.keep_best)."""
    if ln.best is None or ln.best.record is None or ln.best.accuracy is None:
        return {}
    return {"best_version": ln.best.latest(), "best_heldout_acc": round(ln.best.accuracy, 4)}
