"""Per-group score shaping and the DAPO group filters (Yu et al. 2025, "DAPO", Secs. 3.2 and 3.4).

A group's scores are the task rewards plus the soft overlong penalty (`algo.overlong_buffer`),
clamped to +-`algo.reward_clip`: the verl order, where the penalty is part of the reward and
clipping bounds the total. `algo.reward_norm` comes later (learner/step/prepare.py); being affine per
group or per batch, it keeps equal scores equal and unequal ones unequal, so the filters below
decide on the same groups as they would on the scores the advantages see.

`filter_groups` depends on one group at a time, so `collect` can call it as groups arrive and ask
admission for a fresh prompt per dropped group; the learner step gets B groups that all carry signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollflash.algos import clip_rewards, dynamic_sampling_mask, soft_overlong_penalty
from rollflash.broker.config.config_algo import AlgoConfig
from rollflash.broker.wire.schema import Trajectory

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config


@dataclass(frozen=True)
class ScoreSpec:
    """What score shaping and the filters read (`ScoreSpec.of`), built once per run or step."""

    algo: AlgoConfig  # reward_clip, overlong_*, dynamic_sampling
    max_new_tokens: int  # rollout.max_new_tokens: where the soft overlong penalty ends

    @classmethod
    def of(cls, cfg: Config) -> ScoreSpec:
        return cls(cfg.algo, cfg.rollout.max_new_tokens)


def group_scores(group: Trajectory, spec: ScoreSpec) -> torch.Tensor:
    """[n] float32: reward + soft overlong penalty of each sample, clipped (see module docstring)."""
    algo = spec.algo
    scores = torch.tensor([s.reward for s in group.samples], dtype=torch.float32)
    if algo.overlong_buffer is not None:
        lengths = torch.tensor([len(s.response_ids) for s in group.samples])
        scores = scores + soft_overlong_penalty(
            lengths, spec.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty_factor
        )
    return clip_rewards(scores, algo.reward_clip)


def truncated(group: Trajectory) -> torch.Tensor:
    """[n] bool: the sample hit max_new_tokens without EOS."""
    return torch.tensor([not s.finished for s in group.samples], dtype=torch.bool)


def drop_reason(group: Trajectory, spec: ScoreSpec) -> str | None:
    """Why the group would be dropped ("overlong" or "dynamic_sampling"), or None to keep it.

    overlong: with `algo.overlong_filter` every sample is truncated, so nothing is left to train on.
    dynamic_sampling: with `algo.dynamic_sampling` all scores are equal, so every group-relative
    advantage is 0 (DAPO eq. 11's 0 < |correct| < G, generalised to graded rewards).
    """
    if spec.algo.overlong_filter and bool(truncated(group).all()):
        return "overlong"
    if spec.algo.dynamic_sampling and not bool(
        dynamic_sampling_mask(group_scores(group, spec)[None])[0]
    ):
        return "dynamic_sampling"
    return None


def filter_groups(
    groups: list[Trajectory], spec: ScoreSpec
) -> tuple[list[Trajectory], list[Trajectory]]:
    """(kept, dropped), each in the input order; a pure function of each group and `spec`."""
    kept: list[Trajectory] = []
    dropped: list[Trajectory] = []
    for g in groups:
        (dropped if drop_reason(g, spec) else kept).append(g)
    return kept, dropped
