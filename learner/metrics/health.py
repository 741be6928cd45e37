"""Learning health: signs that a rising reward or accuracy is not learning, logged by default.

Two failures a reward curve hides: held-out accuracy that rises because the model gives one
answer to everything, the task's most common one (on reasoning-gym's letter_counting, 0.12 ->
0.86 with every answer "1"), and a reward that rises while held-out accuracy falls (the policy
learns the reward, not the task). From the final answers the task's verifier reads
(envs/answers.py) the learner logs:

- per step, `health/same_answer_frac`: the share of the step's groups (of 2 or more samples)
  whose samples all give the same final answer. Such a group has no advantage to learn from
  under GRPO, and a share that climbs towards 1 is a policy collapsing to one answer a prompt.
- per greedy held-out evaluation, `eval/top_answer_share`: the share of the most common final
  answer among the responses, and `eval/top_answer_acc`: the held-out accuracy of always giving
  it (the response that gave it, scored by the task on every held-out item, at
  `eval.threshold`). summary.json has both before and after training
  (`heldout_top_answer_share_before`, ...).

Two warnings, each one log line when its condition starts to hold (again if it clears and comes
back), 1.0 in `health/majority` or a count in `health/opposed_evals` at that evaluation, and
every one in summary.json's `health_warnings`:

- majority: at an evaluation after training started, held-out accuracy is no better than
  `top_answer_acc` (> 0) while the model gives that answer at least as often as it is right
  (`top_answer_share >= top_answer_acc`): it does no better than always giving its most common
  answer. A model still learning gives it less often than it is right; one that has learned
  beats it.
- opposed: the mean reward of the steps since the previous evaluation and held-out accuracy
  moved in opposite directions at each of the last OPPOSED_EVALS evaluations, and accuracy moved
  by more than two standard errors of a proportion over them (sampling noise of `eval.size`
  items). It needs `eval.every` (at least OPPOSED_EVALS + 2 evaluations).

At start the learner also scores the right answers of a few held-out items and warns, in one
line, when none reaches `eval.threshold` (`threshold_warning`): no response could then count
as right.

What the warnings look at is this learner process's evaluations (a resumed learner starts
afresh). Multi-turn environments and agent programs have no final answer to read: none of this
is logged for them.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflash.broker.wire.schema import Trajectory
from rollflash.envs import Item, Task
from rollflash.envs.answers import final_answer, reference_response

log = logging.getLogger(__name__)

OPPOSED_EVALS = 3  # consecutive evaluations at which reward and accuracy moved apart


def same_answer_frac(groups: Sequence[Sequence[str]]) -> float | None:
    """The share of groups of 2 or more final answers that are all the same (None: no such
    group)."""
    sized = [g for g in groups if len(g) >= 2]
    if not sized:
        return None
    return sum(len(set(g)) == 1 for g in sized) / len(sized)


def step_health(task: Task, groups: Sequence[Trajectory]) -> dict[str, float]:
    """This rank's `health/same_answer_frac` of a step's groups (a mean over the ranks' groups
    when merged, learner/metrics/metrics.py)."""
    answers = [[final_answer(task, g.prompt_id, s.text) for s in g.samples] for g in groups]
    frac = same_answer_frac(answers)
    return {} if frac is None else {"health/same_answer_frac": frac}


@dataclass(frozen=True)
class TopAnswer:
    """The most common final answer of an evaluation's responses."""

    answer: str
    share: float  # of the responses that give it
    acc: float  # held-out accuracy of always giving it


def top_answer(
    task: Task, items: Sequence[Item], responses: Sequence[str], threshold: float
) -> TopAnswer | None:
    """The most common final answer of `responses` (one per item), with the accuracy of the
    response that first gave it when given to every item; None without items, or where the
    task's reward cannot score that response (a reward function that fails on it)."""
    if not items:
        return None
    answers = [final_answer(task, it.id, r) for it, r in zip(items, responses)]
    answer, count = Counter(answers).most_common(1)[0]
    response = responses[answers.index(answer)]
    try:
        score_groups = getattr(task, "score_groups", None)
        if score_groups is not None:
            rewards = [row[0] for row in score_groups(list(items), [[response]] * len(items))]
        else:
            rewards = [task.score(it, response) for it in items]
    except Exception as e:  # the baseline is a diagnostic: it never stops the run
        log.debug("the most common answer could not be scored on the held-out set: %s", e)
        return None
    right = sum(r >= threshold for r in rewards)
    return TopAnswer(answer, count / len(items), right / len(items))


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


@dataclass
class HealthWatch:
    """Feeds on each step's mean reward and each evaluation; says when to warn (module
    docstring). Rank 0's."""

    heldout_size: int
    rewards: list[float] = field(default_factory=list)  # step rewards since the last evaluation
    points: list[tuple[float | None, float]] = field(default_factory=list)  # (reward, accuracy)
    warnings: list[str] = field(default_factory=list)  # every warning raised, in order
    active: set[str] = field(default_factory=set)  # the conditions that hold now

    def step(self, reward_mean: float) -> None:
        self.rewards.append(reward_mean)

    def evaluated(self, step: int, accuracy: float, top: TopAnswer | None) -> dict[str, float]:
        """The evaluation's health metrics; logs a warning whose condition starts to hold."""
        if self.rewards or not self.points:  # an evaluation of weights already evaluated adds
            reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
            self.points.append((reward, accuracy))  # no point to the trend
            self.rewards = []
        out: dict[str, float] = {}
        majority = False
        if top is not None:
            out["eval/top_answer_share"], out["eval/top_answer_acc"] = top.share, top.acc
            majority = step > 0 and 0 < top.acc and accuracy <= top.acc <= top.share
            self._warn(
                "majority",
                majority,
                f"step {step}: held-out accuracy {accuracy:.3f} is no better than always "
                f"answering {top.answer[:40]!r} ({top.acc:.3f}), which the model gives in "
                f"{top.share:.0%} of its held-out responses: the accuracy is the most common "
                "answer's, not learning (learner/metrics/health.py)",
            )
        opposed = self._opposed()
        out["health/majority"], out["health/opposed_evals"] = float(majority), float(opposed)
        window = self.points[-OPPOSED_EVALS - 1 :]
        self._warn(
            "opposed",
            opposed >= OPPOSED_EVALS and self._beyond_noise(window[0][1], window[-1][1]),
            self._opposed_message(step, window),
        )
        return out

    def _opposed(self) -> int:
        """How many of the latest evaluations in a row moved reward and accuracy apart."""
        rated = [(r, a) for r, a in self.points if r is not None]
        run = 0
        for (r0, a0), (r1, a1) in reversed(list(zip(rated, rated[1:]))):
            if _sign(r1 - r0) * _sign(a1 - a0) >= 0:
                break
            run += 1
        return run

    def _beyond_noise(self, before: float, after: float) -> bool:
        p = (before + after) / 2
        return abs(after - before) > 2 * math.sqrt(p * (1 - p) / max(self.heldout_size, 1))

    @staticmethod
    def _opposed_message(step: int, window: list[tuple[float | None, float]]) -> str:
        rated = [(r, a) for r, a in window if r is not None]
        if len(rated) < 2:
            return ""
        (r0, a0), (r1, a1) = rated[0], rated[-1]
        reward = "rose" if r1 > r0 else "fell"
        acc = "fell" if reward == "rose" else "rose"
        return (
            f"step {step}: the reward {reward} and held-out accuracy {acc} at each of the last "
            f"{OPPOSED_EVALS} evaluations (reward {r0:.3f} -> {r1:.3f}, accuracy {a0:.3f} -> "
            f"{a1:.3f}): the policy is learning the reward, not the task (learner/metrics/health.py)"
        )

    def _warn(self, name: str, holds: bool, message: str) -> None:
        if holds and name not in self.active:
            log.warning("learning health: %s", message)
            self.warnings.append(message)
        (self.active.add if holds else self.active.discard)(name)


PROBED_ITEMS = 8  # held-out items whose right answers are scored at start


def threshold_warning(task: Task, items: Sequence[Item], threshold: float) -> str | None:
    """One line when the right answers of the first PROBED_ITEMS held-out items, written as the
    task expects them (envs/answers.py `reference_response`), all score below `threshold`:
    greedy accuracy would then count no response right, whatever the model learns (a length
    penalty that puts a right answer at 0.97 under a threshold of 1.0). None when one reaches
    it, or when the task cannot write a right answer."""
    probes = [(it, reference_response(task, it)) for it in items[:PROBED_ITEMS]]
    written = [(it, r) for it, r in probes if r is not None]
    if not written:
        return None
    try:
        scores = [float(task.score(it, r)) for it, r in written]
    except Exception as e:  # a check, not a gate: the evaluation meets the same error itself
        log.debug("the held-out answers could not be scored: %s", e)
        return None
    best = max(range(len(scores)), key=scores.__getitem__)
    if scores[best] >= threshold:
        return None
    item, response = written[best]
    return (
        f"eval.threshold: {threshold:g} is above what a right answer scores: the held-out "
        f"answers themselves, as responses, score at most {scores[best]:.4g} ({item.id}: "
        f"{response[:40]!r}), so held-out accuracy will count no response right; lower "
        "eval.threshold, or change reward.functions / reward.weights"
    )


def summary_fields(top: TopAnswer | None, when: str) -> dict[str, Any]:
    """summary.json's fields of an evaluation's most common answer (`when`: before, after)."""
    if top is None:
        return {}
    return {
        f"heldout_top_answer_share_{when}": round(top.share, 4),
        f"heldout_top_answer_acc_{when}": round(top.acc, 4),
    }
