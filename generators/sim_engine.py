"""A simulated engine that emulates GPU decode timing, to measure scheduling apart from compute.

Each sample draws a response length from a long-tail (log-normal) distribution, capped at
`max_new_tokens`. Decoding advances all unfinished sequences of a batch one token per step, and a
step takes `per_token_s * (1 + batch_slowdown * (active - 1))`: a batch of many sequences is
faster per token than one at a time but slower per step, as on a GPU. Time passes with `sleep`, so
several simulated generators share two CPU cores without disturbing each other.

Tokens are random ids and log-probabilities a fixed -1.0; rewards from a verifier are meaningless,
which is fine for scheduling measurements. With `interrupt`, a new weight version published
mid-generation is picked up between decode steps and the remaining tokens carry the new version.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

from broker.config import SimConfig
from generators.engine import GeneratedSample, SamplingParams


class SimEngine:
    def __init__(self, sim: SimConfig, seed: int):
        self.sim = sim
        self.vocab_size = sim.vocab_size
        self.rng = random.Random(seed)
        self.version = 0

    def load_weights(self, model_file: Path, version: int) -> None:
        self.version = version

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams,
                     on_step: Callable[[], None] | None = None) -> list[list[GeneratedSample]]:
        """Multi-turn episodes: the same timing model; the context's length is not simulated
        (decode steps dominate, prefill is ignored, as in `generate`)."""
        groups = self.generate([""] * len(prompts), params, on_step)
        for ids, group in zip(prompts, groups):
            for sample in group:
                sample.prompt_ids = list(ids)
        return groups

    def observation_encoder(self) -> Callable[[str, bool], list[int]]:
        """One token per character, mapped into the simulated vocabulary."""
        span = self.vocab_size - 3
        return lambda text, first: ([1] if first else []) + [3 + ord(c) % span for c in text]

    def _length(self, cap: int) -> int:
        return max(1, min(cap, round(self.rng.lognormvariate(0.0, self.sim.length_sigma)
                                     * self.sim.length_median)))

    def generate(self, prompts: list[str], params: SamplingParams,
                 on_step: Callable[[], None] | None = None) -> list[list[GeneratedSample]]:
        rows = [(p, self._length(params.max_new_tokens)) for p in prompts for _ in range(params.n)]
        versions: list[list[int]] = [[] for _ in rows]
        active = len(rows)
        step = 0
        while active:
            time.sleep(self.sim.per_token_s * (1 + self.sim.batch_slowdown * (active - 1)))
            for i, (_, length) in enumerate(rows):
                if step < length:
                    versions[i].append(self.version)
            step += 1
            active = sum(1 for _, length in rows if length > step)
            if on_step is not None and active:
                on_step()  # may swap weights in (interrupt mode): later tokens get the new version
        out: list[list[GeneratedSample]] = [[] for _ in prompts]
        for i, (_, length) in enumerate(rows):
            ids = [self.rng.randrange(3, self.vocab_size) for _ in range(length)]
            out[i // params.n].append(GeneratedSample(
                prompt_ids=[1, 3], response_ids=ids, logprobs=[-1.0] * length,
                finished=length < params.max_new_tokens, text="", token_versions=versions[i]))
        return out
