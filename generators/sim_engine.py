"""A simulated engine that emulates GPU decode timing, to measure scheduling apart from compute.

Each sample draws a response length from a long-tail (log-normal) distribution, capped at
`max_new_tokens`. Decoding advances every unfinished sequence one token per step, and a step takes
`per_token_s * (1 + batch_slowdown * (active - 1))`: a batch of many sequences is faster per token
than one at a time but slower per step, as on a GPU. Time passes with `sleep`, so several
simulated generators share two CPU cores without disturbing each other.

Two ways to drive it, as with a real serving engine:
- `generate`: a batch of prompts run to completion (what the hf engine does);
- continuous batching (`add_request` / `step` / `abort`): requests join and leave between decode
  steps, so a finished sequence's slot is taken by a new one at once (what vLLM does; used by
  generators/continuous.py).

Response tokens are random ids and log-probabilities a fixed -1.0; rewards from a verifier are
meaningless, which is fine for scheduling measurements. Prompt tokens are the ones the learner
derives and checks (envs/chat.py `prompt_encoder`): with the tokenizer of `model.path` when that
names a model directory, else one id per character, as the simulated learner does too. Every
response token records the weight version loaded when it was decoded, so a version swapped in
mid-generation (`interrupt`) shows in the later tokens.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollflash.broker.config.config import Config, SimConfig
from rollflash.broker.config.model_dir import tokenizer_if_present
from rollflash.envs.chat import prompt_encoder
from rollflash.envs.episode import Encode, char_encoder, encoder_for
from rollflash.generators.sampling import GeneratedSample, Groups, OnStep, SamplingParams


@dataclass
class _Seq:
    key: str
    length: int
    cap: int
    prompt_ids: list[int]
    versions: list[int] = field(default_factory=list)


class SimEngine:
    def __init__(self, sim: SimConfig, seed: int, tokenizer: Any = None):
        self.sim = sim
        self.vocab_size = sim.vocab_size
        self._tokenizer = tokenizer  # prompts' and observations' (module docstring); None: chars
        self._encode_prompt = prompt_encoder(tokenizer, False, sim.vocab_size)
        self.rng = random.Random(seed)
        self.version = 0
        self._active: list[_Seq] = []

    @classmethod
    def from_config(cls, cfg: Config, seed: int) -> SimEngine:
        """The timing of `cfg.sim`; `seed` draws the response lengths and token ids."""
        return cls(cfg.sim, seed, tokenizer_if_present(cfg.model.path, cfg.model.trust_remote_code))

    def new_weights(self, layout: list[tuple[str, tuple[int, ...], Any]]) -> dict[str, Any]:
        """Tensors that keep nothing (the meta device): a simulated model has no weights, like an
        engine whose weights live on a GPU, the host keeps none of a version's bytes."""
        import torch

        return {
            name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in layout
        }

    def swap_weights(self, weights: dict[str, Any], version: int) -> None:
        self.version = version

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        """A LoRA adapter version (model.lora) times the same: only its version is recorded."""
        self.version = version

    # --- continuous batching --------------------------------------------------------------------
    def add_request(self, key: str, prompt: str, params: SamplingParams) -> None:
        """Start `params.n` samples of `prompt`; they come back from `step` under `key`."""
        prompt_ids = self._encode_prompt(prompt)
        for _ in range(params.n):
            length = max(
                1,
                min(
                    params.max_new_tokens,
                    round(
                        self.rng.lognormvariate(0.0, self.sim.length_sigma) * self.sim.length_median
                    ),
                ),
            )
            self._active.append(_Seq(key, length, params.max_new_tokens, prompt_ids))

    def abort(self, key: str) -> None:
        """Drop the unfinished samples of `key` (redundant samples no longer needed)."""
        self._active = [s for s in self._active if s.key != key]

    @property
    def num_active(self) -> int:
        return len(self._active)

    def step(self) -> list[tuple[str, GeneratedSample]]:
        """One decode step of every active sequence; returns the samples that finished."""
        if not self._active:
            return []
        time.sleep(self.sim.per_token_s * (1 + self.sim.batch_slowdown * (len(self._active) - 1)))
        done = []
        for s in self._active:
            s.versions.append(self.version)
        for s in [s for s in self._active if len(s.versions) >= s.length]:
            ids = [self.rng.randrange(3, self.vocab_size) for _ in range(s.length)]
            done.append(
                (
                    s.key,
                    GeneratedSample(
                        prompt_ids=list(s.prompt_ids),
                        response_ids=ids,
                        logprobs=[-1.0] * s.length,
                        finished=s.length < s.cap,
                        text="",
                        token_versions=s.versions,
                    ),
                )
            )
        self._active = [s for s in self._active if len(s.versions) < s.length]
        return done

    # --- whole batches --------------------------------------------------------------------------
    def generate(
        self, prompts: list[str], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        one = dataclasses.replace(params, n=1)
        for i, prompt in enumerate(prompts):
            for k in range(params.n):
                self.add_request(f"{i}/{k}", prompt, one)
        slots: dict[str, GeneratedSample] = {}
        while self._active:
            slots.update(self.step())
            if on_step is not None and self._active:
                on_step()  # may swap weights in (interrupt mode): later tokens get the new version
        return [[slots[f"{i}/{k}"] for k in range(params.n)] for i in range(len(prompts))]

    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """Multi-turn episodes: the same timing model; the context's length is not simulated
        (decode steps dominate, prefill is ignored, as in `generate`)."""
        groups = self.generate([""] * len(prompts), params, on_step)
        for ids, group in zip(prompts, groups):
            for sample in group:
                sample.prompt_ids = list(ids)
        return groups

    def observation_encoder(self) -> Encode:
        """The tokenizer's episode encoder, or one token per character (module docstring)."""
        if self._tokenizer is not None:
            return encoder_for(self._tokenizer)
        return char_encoder(self.vocab_size)
