"""Which samples of a step are logged as completions (`logging.completions_per_step: N`).

The N samples are chosen to be informative rather than typical: the best-rewarded sample of the
step first, then the worst, then samples drawn uniformly at random from the rest (ties broken by
order of arrival). Best and worst show what the reward is paying for and what it punishes (a
reward hack usually shows up as the best sample first); the random ones show what the policy
mostly does. The draw uses its own generator seeded by (run.seed, step), so logging completions
never changes the training's random state, and a re-run logs the same samples.

Each row holds the prompt and response text, the reward and its parts (the per-turn rewards of a
multi-turn episode; a single-turn sample's reward is one part), whether the response finished,
its length, its staleness (learner version at collection minus the group's behaviour version),
the behaviour version, the generator id and the trajectory id. With several learner ranks, rank
0 picks from its own share of the step.
"""

from __future__ import annotations

import random
from typing import Any

from rollflash.broker.wire.schema import Trajectory


def pick_completions(
    groups: list[Trajectory], n: int, version: int, seed: int, step: int, decode: Any
) -> list[dict[str, Any]]:
    """The `n` rows to log for a step whose groups were collected at learner `version`;
    `decode(token_ids) -> str` renders the prompt (and a response without text)."""
    pool = [(g, s) for g in groups for s in g.samples]
    if n <= 0 or not pool:
        return []
    order = list(range(len(pool)))
    best = max(order, key=lambda i: pool[i][1].reward)
    worst = min(order, key=lambda i: pool[i][1].reward)
    picked = [(best, "best")] + ([(worst, "worst")] if worst != best else [])
    rest = [i for i in order if i not in (best, worst)]
    rng = random.Random(seed * 1_000_003 + step)
    picked += [(i, "random") for i in rng.sample(rest, min(len(rest), max(0, n - len(picked))))]
    return [_row(*pool[i], pick, version, decode) for i, pick in picked[:n]]


def _row(g: Trajectory, s: Any, pick: str, version: int, decode: Any) -> dict[str, Any]:
    parts = [float(r) for r in s.turn_rewards] if s.turn_rewards is not None else [s.reward]
    return {
        "pick": pick,
        "prompt": decode(g.prompt_ids.tolist()),
        "response": s.text or decode(s.response_ids.tolist()),
        "reward": float(s.reward),
        "reward_parts": parts,
        "finished": bool(s.finished),
        "length": int(len(s.response_ids)),
        "staleness": int(version - g.behavior_version),
        "behavior_version": int(g.behavior_version),
        "generator": g.generator,
        "traj_id": g.traj_id,
    }
