"""Admission control: how many prompts may be in the system for the learner's current version.

ARCHITECTURE.md: while the learner is at version v, the total number of prompts ever issued is at
most (v + 1 + a) * B, where a = `async_ratio` and B = `rollout_batch_size`. A group the learner
throws away (stale, duplicate-free but rejected, or filtered) is replaced by a fresh prompt, so the
bound counts `replaced` on top: issued <= floor((v + 1 + a) * B) + replaced.

The bound counts prompts (groups). With `rollout.replicate_prompts` each prompt becomes n + r
entries of one sample each, which generators pick up independently.

With a = 0 this issues exactly B prompts per version, each tagged with the version it was issued
for; generators refuse to start a prompt with older weights, which makes training on-policy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

from broker.schema import PromptWork
from broker.streams import RunBroker
from envs import Item


class Admission:
    def __init__(self, items: Iterator[Item], batch_size: int, async_ratio: float,
                 group_size: int, replicas: int = 0, issued: int = 0, replaced: int = 0):
        self.items = items
        self.batch_size = batch_size
        self.async_ratio = async_ratio
        self.group_size = group_size
        self.replicas = replicas  # > 0: one entry per sample, this many (n + redundant) per group
        self.issued = issued  # prompts ever issued in this run
        self.replaced = replaced  # groups thrown away and replaced by fresh prompts

    def allowance(self, version: int) -> int:
        return math.floor((version + 1 + self.async_ratio) * self.batch_size) + self.replaced

    def replace(self, count: int) -> None:
        self.replaced += count

    def top_up(self, broker: RunBroker, version: int) -> int:
        """Issue prompts up to the allowance for `version`; returns how many were issued."""
        room = self.allowance(version) - self.issued
        if room <= 0:
            return 0
        works = []
        for i in range(room):
            item = dataclasses.asdict(next(self.items))
            group_id = f"g{self.issued + i:09d}"
            if self.replicas:
                works += [PromptWork(prompt_id=item["id"], group_id=group_id, n=1,
                                     issued_version=version, item=item, sample_index=k)
                          for k in range(self.replicas)]
            else:
                works.append(PromptWork(prompt_id=item["id"], group_id=group_id,
                                        n=self.group_size, issued_version=version, item=item))
        broker.add_prompts(works)
        self.issued += room
        broker.set_run_fields(issued=self.issued, replaced=self.replaced)
        return room
