"""The inference-engine interface that the rollout loop drives, and the table of engines.

Implementations: `hf` (Hugging Face transformers, CPU or GPU), `sim` (simulated timing, for
scheduling benchmarks) and `vllm` (vLLM, GPU or its CPU build; `make test-vllm`). A new weight
version reaches an engine as tensors (`TensorEngine`: hf, sim) or as a file (`FileEngine`:
vllm). What they take and return (`SamplingParams`, `GeneratedSample`, the log-probability
contract) is in generators/sampling.py, the only module of this package an engine imports. This
module names the engines by import path in `ENGINES` and imports only the one a config asks for,
so torch or vllm load only in a generator that uses them. A new engine is a class with a
`from_config(cfg, seed)` classmethod and one line in `ENGINES`.

An engine whose package is not installed (`ENGINE_PACKAGES`) is refused before the generator
joins the run, with one line naming the install command (`EngineUnavailable`); `rollctl` exits
with the code that makes `rollctl run` stop the whole run (every generator would fail alike).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rollflash.broker.config.config import Config, ConfigError
from rollflash.envs.episode import Encode
from rollflash.errors import RollflashError
from rollflash.generators.sampling import GeneratedSample, Groups, OnStep, SamplingParams

if TYPE_CHECKING:
    import torch


class Engine(Protocol):
    vocab_size: int

    def generate(
        self, prompts: list[str], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """Return, for each prompt, its `params.n` samples. An engine that can swap weights
        mid-generation calls `on_step` between decode steps (interrupt mode)."""
        ...


class TensorEngine(Engine, Protocol):
    """Engines that swap in a version's tensors (`hf`, `sim`; generators/reload.py): the reload
    thread fills the tensors `new_weights` allocates while the engine keeps sampling, and only
    `swap_weights` pauses it."""

    def new_weights(
        self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Empty tensors (on the engine's device) for a version of these names, shapes and
        dtypes; ValueError, before anything is allocated, when they do not fit the model."""
        ...

    def swap_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make the filled, verified `weights` the model's."""
        ...


class FileEngine(Engine, Protocol):
    """Engines that load a version from a file (`vllm`: its worker reads the file itself)."""

    def load_weights(self, model_file: Path, version: int) -> None:
        """Load a verified safetensors file (a private copy) into the running engine."""
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
    """What multi-turn environments need besides `generate` (engines `hf`, `vllm` and `sim`)."""

    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """As `generate`, from token ids: each episode continues from its exact token context."""
        ...

    def observation_encoder(self) -> Encode:
        """(observation text, is_first) -> token ids (see envs/episode.py)."""
        ...


# rollout.engine -> "module:class"; the class builds itself with `from_config(cfg, seed)`
ENGINES: dict[str, str] = {
    "hf": "rollflash.generators.hf_engine:HFEngine",
    "sim": "rollflash.generators.sim_engine:SimEngine",
    "vllm": "rollflash.generators.vllm_engine:VLLMEngine",
}


# rollout.engine -> (the package it needs, how to install it)
ENGINE_PACKAGES: dict[str, tuple[str, str]] = {
    "vllm": (
        "vllm",
        'on a GPU machine pip install -e ".[vllm]", on CPU make install-vllm (then run '
        "rollctl from .venv-vllm)",
    ),
}


class EngineUnavailable(RollflashError, RuntimeError):
    """The engine `rollout.engine` names cannot be imported in this Python."""


def check_engine(cfg: Config) -> None:
    """Raise EngineUnavailable, naming the install command, if `rollout.engine`'s package is
    not installed; checked before anything waits on Redis or loads a model."""
    need = ENGINE_PACKAGES.get(cfg.rollout.engine)
    if need is not None and importlib.util.find_spec(need[0]) is None:
        raise EngineUnavailable(
            f"rollout.engine: {cfg.rollout.engine} is not installed in {sys.executable}; "
            f"install it: {need[1]}"
        )


def make_engine(cfg: Config, seed: int) -> Engine:
    """Import the engine class that `rollout.engine` names and build it from `cfg`; `seed` seeds
    its sampling."""
    name = cfg.rollout.engine
    if name not in ENGINES:
        raise ConfigError(
            f"rollout.engine: unknown engine {name!r}; use one of {', '.join(sorted(ENGINES))}"
        )
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls).from_config(cfg, seed)
