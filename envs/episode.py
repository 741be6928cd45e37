"""One episode as the token sequence the learner trains on.

The model sees, and the learner re-scores, exactly one token sequence per episode:

    prompt_ids = encode(first observation)
    response   = action_1 [EOS] obs_1  action_2 [EOS] obs_2 ... action_K [EOS]
    loss_mask  =    1 ...   1    0...0   1 ...   1    0...0      1 ...   1

Actions are the tokens the engine generated (EOS included when the turn stopped on it); observation
tokens come from `encode(observation, first=False)` and are appended after the action, so the next
turn is generated from the very tokens the learner will later see: no re-tokenisation of the
concatenated text, which for BPE tokenisers would not reproduce the sampled tokens. Observation
tokens carry a loss mask of 0, a behaviour log-probability of 0 (never used) and the version of the
turn before them.

An environment that raises does not end the process that runs the episode: an exception from
`reset` makes the first observation an error line and ends the episode at its first action; one
from `step` ends the episode there (truncated, reward 0 for the turn), since the environment's
state is unknown; one from `close` is logged. Each, and each step whose info carries
"env_error" (a tool that failed but let the episode go on, envs/tools.py), adds one to
`env_errors`, which the trajectory carries to the learner's `env/errors` metric.

Per turn the episode records where the action starts (`turn_starts`, an index into the response),
the turn's reward, and `turn_states`, a 63-bit hash of the observation the action answered: turns of
different episodes in a group with the same state key are "the same state" for GiGPO-style step
grouping (algos/turn_advantages.py).

Encoders (duck-typed tokenizers, no torch):
- `plain_encoder`: observation text tokenised as is, special tokens (e.g. `<bos>`) only on the
  first observation. For models without a chat template, such as the tiny test models.
- `chat_encoder`: the first observation as a user message with the generation prompt; each later
  one as the template's text between the end of an assistant message and the next generation
  prompt (a user message in between), found by rendering the template.
- `encoder_for`: the chat encoder for a tokenizer with a chat template, else the plain one (what
  the engines and evaluation use).
- `char_encoder`: one token per character, for processes that load no tokenizer (the simulated
  engine and learner).

The first observation is the one the learner issued (`first_observation`, the prompt's text):
the learner checks the episode's prompt tokens against it (broker/channels/provenance.py), so an
environment whose `reset` failed here still starts from the issued text (and ends at the first
action). Observations after the first come from this process's environment; the learner takes
them as they are, within the wire's bounds.

Stdlib only.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollflash.envs.multiturn import Env, StepResult

log = logging.getLogger(__name__)
Encode = Callable[[str, bool], list[int]]  # (observation text, is_first) -> token ids


def state_key(observation: str) -> int:
    """A stable 63-bit hash of an observation (the same across processes, unlike hash())."""
    return (
        int.from_bytes(hashlib.blake2b(observation.encode(), digest_size=8).digest(), "little") >> 1
    )


def plain_encoder(tokenizer: Any) -> Encode:
    def encode(text: str, first: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=first)["input_ids"])

    return encode


def chat_encoder(tokenizer: Any) -> Encode:
    """Observation tokens for a model with a chat template (see the module docstring)."""
    eos_text = tokenizer.decode([tokenizer.eos_token_id])

    def render(messages: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def encode(text: str, first: bool) -> list[int]:
        user = {"role": "user", "content": text}
        if first:
            return list(tokenizer(render([user], True), add_special_tokens=False)["input_ids"])
        # the text the template puts after an assistant turn's EOS, then the user turn and prompt
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        closed = render(before, False)
        cut = closed.rindex(eos_text) + len(eos_text)
        full = render(before + [user], True)
        if not full.startswith(closed[:cut]):
            raise ValueError(
                "the chat template does not extend a conversation by appending; "
                "use a model without a chat template or a plain encoder"
            )
        return list(tokenizer(full[cut:], add_special_tokens=False)["input_ids"])

    return encode


def char_encoder(vocab_size: int) -> Encode:
    """One token per character, mapped into ids 3 .. vocab_size - 1, and id 1 before the first
    observation: what processes that load no tokenizer use (the simulated engine and learner)."""
    span = vocab_size - 3

    def encode(text: str, first: bool) -> list[int]:
        return ([1] if first else []) + [3 + ord(c) % span for c in text]

    return encode


def encoder_for(tokenizer: Any) -> Encode:
    """How episodes render observations for `tokenizer`: its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return chat_encoder(tokenizer)
    return plain_encoder(tokenizer)


@dataclass
class Episode:
    """The running record of one episode; `act` plays one turn."""

    env: Env
    seed: int
    encode: Encode
    max_tokens: int  # response budget (actions + observations); the episode is cut when exceeded
    action_tokens: int = 0  # longest action (max_new_tokens): cut when the next could not fit
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on action tokens, 0 on observations
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_states: list[int] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # decoded action texts, for inspection
    done: bool = False  # no more turns: the env ended the episode or a limit cut it
    success: bool = False  # info["success"] of the last step
    truncated: bool = False  # ended by the env's turn limit or the token budget
    observation: str = ""
    env_errors: int = 0  # exceptions of the environment and failed tools (module docstring)
    broken: bool = False  # reset raised: the next action ends the episode
    first_observation: str | None = None  # as the learner issued it (module docstring)

    def __post_init__(self) -> None:
        try:
            self.observation = self.env.reset(self.seed)
        except Exception as e:
            self._env_error("reset", e)
            self.observation, self.broken = (
                f"error: environment failed ({type(e).__name__})\n",
                True,
            )
        if self.first_observation is not None:
            self.observation = self.first_observation
        self.prompt_ids = self.encode(self.observation, True)

    def _env_error(self, where: str, e: Exception) -> None:
        self.env_errors += 1
        log.warning("environment %s failed in episode seed %d: %r", where, self.seed, e)

    def _step(self, text: str) -> StepResult:
        """env.step, with an exception turned into the end of the episode."""
        if self.broken:
            return StepResult("", 0.0, True, {"truncated": True})
        try:
            result = self.env.step(text)
        except Exception as e:
            self._env_error("step", e)
            return StepResult("", 0.0, True, {"truncated": True})
        if result.info.get("env_error"):
            self.env_errors += 1
            log.warning("tool failed in episode seed %d: %s", self.seed, result.info["env_error"])
        return result

    @property
    def context(self) -> list[int]:
        """The tokens the next action is generated from."""
        return self.prompt_ids + self.response_ids

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    def act(self, ids: list[int], logprobs: list[float], versions: list[int], text: str) -> None:
        """Record one generated action (tokens, behaviour log-probs, versions, decoded text without
        EOS), step the environment with `text`, and append its observation unless the episode ended."""
        if self.done:
            raise RuntimeError("act() on a finished episode")
        if not ids or not len(ids) == len(logprobs) == len(versions):
            raise ValueError("an action needs >= 1 token, with one logprob and version per token")
        self.turn_starts.append(len(self.response_ids))
        self.actions.append(text)
        self.turn_states.append(state_key(self.observation))
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        result = self._step(text)
        self.turn_rewards.append(float(result.reward))
        self.success = bool(result.info.get("success", False))
        if result.done:
            self.done, self.truncated = True, bool(result.info.get("truncated", False))
            return
        self.observation = result.observation
        obs = self.encode(result.observation, False)
        self.response_ids += obs
        self.loss_mask += [0] * len(obs)
        self.logprobs += [0.0] * len(obs)
        self.versions += [versions[-1]] * len(obs)
        if len(self.response_ids) + max(self.action_tokens, 1) > self.max_tokens:
            self.done, self.truncated = True, True

    def close(self) -> None:
        try:
            self.env.close()
        except Exception as e:
            self._env_error("close", e)
