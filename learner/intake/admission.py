"""Admission control: how many prompts may be in the system for the learner's current version.

ARCHITECTURE.md: while the learner is at step s (version v without a resume), the total number of
prompts ever issued is at most (s + 1 + a) * B, where a = `async_ratio` and B =
`rollout_batch_size`. A group the learner throws away (stale, rejected by validation, or filtered)
is replaced by a fresh prompt, so the bound counts `replaced` on top:
issued <= floor((s + 1 + a) * B) + replaced.

Both counters live in the run hash and are never reset: `issued` is written in the transaction
that adds the prompts, and `replaced` is incremented (by whichever learner rank drops a group) in
the transaction that acknowledges the dropped entries. A resumed learner therefore continues from
the exact counts; only rank 0 issues prompts, and it re-reads `replaced` before each top-up.

The bound counts prompts (groups). With `rollout.replicate_prompts` each prompt becomes n + r
entries of one sample each, which generators pick up independently.

With a = 0 this issues exactly B prompts per step, each tagged with the version it was issued
for; generators refuse to start a prompt with older weights, which makes training on-policy.

Each prompt is issued with the token ids its text becomes (`prompt_ids`, envs/chat.py
`prompt_encoder`), which its MAC signs: the learner trains a group only with those
(broker/channels/provenance.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.wire.schema import PromptWork
from rollflash.envs import Item


class Admission:
    def __init__(
        self,
        items: Iterator[Item],
        batch_size: int,
        async_ratio: float,
        group_size: int,
        replicas: int = 0,
        issued: int = 0,
        replaced: int = 0,
        prompt_ids: Callable[[str], list[int]] | None = None,
    ):
        self.items = items
        self.batch_size = batch_size
        self.async_ratio = async_ratio
        self.group_size = group_size
        self.replicas = replicas  # > 0: one entry per sample, this many (n + redundant) per group
        self.issued = issued  # prompts ever issued in this run
        self.replaced = replaced  # groups thrown away and replaced by fresh prompts
        self.prompt_ids = prompt_ids  # a prompt's text -> its ids; None: not checked (agents)

    def allowance(self, step: int) -> int:
        return math.floor((step + 1 + self.async_ratio) * self.batch_size) + self.replaced

    def top_up(self, broker: LearnerBroker, step: int, version: int | None = None) -> int:
        """Issue prompts up to the allowance for `step`, tagged with `version` (default: step);
        returns how many were issued."""
        version = step if version is None else version
        self.replaced = broker.replaced_groups()
        room = self.allowance(step) - self.issued
        if room <= 0:
            return 0
        works = []
        for i in range(room):
            item = dataclasses.asdict(next(self.items))
            group_id = f"g{self.issued + i:09d}"
            ids = self.prompt_ids(item["prompt"]) if self.prompt_ids is not None else None
            if self.replicas:
                works += [
                    PromptWork(
                        prompt_id=item["id"],
                        group_id=group_id,
                        n=1,
                        issued_version=version,
                        item=item,
                        sample_index=k,
                        prompt_ids=ids,
                    )
                    for k in range(self.replicas)
                ]
            else:
                works.append(
                    PromptWork(
                        prompt_id=item["id"],
                        group_id=group_id,
                        n=self.group_size,
                        issued_version=version,
                        item=item,
                        prompt_ids=ids,
                    )
                )
        broker.add_prompts(works, issued=self.issued + room)
        self.issued += room
        return room
