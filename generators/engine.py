"""The inference-engine interface that the rollout loop drives.

An engine samples `n` responses per prompt and returns, for every generated token, the log-probability
the sampling distribution gave it: log_softmax(logits / temperature) before top-p truncation. The
learner recomputes the same quantity, so the two can be compared token by token.

Implementations: `hf` (Hugging Face transformers, CPU or GPU) and `sim` (simulated timing, for
scheduling benchmarks) and `vllm` (vLLM, GPU or its CPU build; `make test-vllm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollflash.broker.config import Config


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass
class GeneratedSample:
    prompt_ids: list[int]
    response_ids: list[int]  # generated tokens, EOS included if the sample stopped
    logprobs: list[float]  # behaviour log-probability of each response token
    finished: bool  # ended with EOS (False: cut at max_new_tokens)
    text: str  # decoded response without special tokens
    token_versions: list[int] | None = None  # weight version per token; None: all the loaded one


class Engine(Protocol):
    vocab_size: int

    def generate(
        self, prompts: list[str], params: SamplingParams, on_step: Callable[[], None] | None = None
    ) -> list[list[GeneratedSample]]:
        """Return, for each prompt, its `params.n` samples. An engine that can swap weights
        mid-generation calls `on_step` between decode steps (interrupt mode)."""
        ...

    def load_weights(self, model_file: Path, version: int) -> None:
        """Load a verified safetensors file into the running engine."""
        ...


class StreamingEngine(Engine, Protocol):
    """Continuous batching (engines `vllm` and `sim`; generators/continuous.py): requests join
    and leave between decode steps."""

    num_active: int  # sequences in flight

    def add_request(self, key: str, prompt: str, params: SamplingParams) -> None:
        """Start `params.n` samples of `prompt`, returned by `step` under `key`."""
        ...

    def step(self) -> list[tuple[str, GeneratedSample]]:
        """One decode step of every sequence in flight; returns the samples that finished."""
        ...

    def abort(self, key: str) -> None:
        """Stop the unfinished samples of `key`."""
        ...


class EpisodeEngine(Engine, Protocol):
    """What multi-turn environments need besides `generate` (engines `hf` and `sim`)."""

    def generate_ids(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_step: Callable[[], None] | None = None,
    ) -> list[list[GeneratedSample]]:
        """As `generate`, from token ids: each episode continues from its exact token context."""
        ...

    def observation_encoder(self) -> Callable[[str, bool], list[int]]:
        """(observation text, is_first) -> token ids (see envs/episode.py)."""
        ...


def make_engine(cfg: Config, seed: int) -> Engine:
    name = cfg.rollout.engine
    if name == "hf":
        from rollflash.generators.hf_engine import HFEngine

        return HFEngine(cfg.model.path, dtype=cfg.model.dtype)
    if name == "sim":
        from rollflash.generators.sim_engine import SimEngine

        return SimEngine(cfg.sim, seed)
    if name == "vllm":
        import os

        # read by vLLM's CPU backend only: unpinned OpenMP threads (5x faster on a shared
        # machine), a 1 GiB KV cache; set before vllm is imported, a user's own values win
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from rollflash.generators.vllm_engine import VLLMEngine

        return VLLMEngine(cfg.model.path, dtype=cfg.model.dtype, seed=seed)
    raise NotImplementedError(f"rollout.engine: {name!r} is not available yet; use 'hf' or 'sim'")
