"""What crosses the engine interface: the sampling request and the samples that come back.

An engine samples `n` responses per prompt and returns, for every generated token, the log-probability
the sampling distribution gave it: log_softmax(logits / temperature) before top-p truncation. The
learner recomputes the same quantity, so the two can be compared token by token.

The engines (generators/hf_engine.py, sim_engine.py, vllm_engine.py) import these types and nothing
else of the generator package; the rollout loop finds them through generators/engine.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollflash.broker.config.config import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    n: int  # samples per prompt
    temperature: float  # > 0; behaviour log-probabilities are log_softmax(logits / temperature)
    top_p: float  # nucleus sampling; 1.0 samples from the whole distribution
    max_new_tokens: int  # a sample that reaches it is cut (finished=False)

    @classmethod
    def for_rollout(cls, rollout: RolloutConfig, n: int) -> SamplingParams:
        """`n` samples per prompt at `rollout.temperature`, `top_p` and `max_new_tokens`."""
        return cls(
            n=n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
        )


@dataclass
class GeneratedSample:
    prompt_ids: list[int]
    response_ids: list[int]  # generated tokens, EOS included if the sample stopped
    logprobs: list[float]  # behaviour log-probability of each response token
    finished: bool  # ended with EOS (False: cut at max_new_tokens)
    text: str  # decoded response without special tokens
    token_versions: list[int] | None = None  # weight version per token; None: all the loaded one


Groups = list[list[GeneratedSample]]  # for each prompt, in order, its `n` samples
OnStep = Callable[[], object]  # runs between decode steps (interrupt mode); may swap weights in
