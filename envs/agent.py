"""Agent programs (`rollout.agent: "pkg.module:run_episode"`): the user's function, what each of
its model calls records, and how an episode's calls become the sequence the learner trains on.

    def run_episode(client: openai.OpenAI, item: Item) -> float | dict      # or `async def`,
                                                                           # with openai.AsyncOpenAI

`client` talks to the generator's OpenAI-compatible endpoint (envs/agent_server.py); `item` is
the task's item (`prompt`, `answer`, `id`, `extra`: raw, no chat template applied). The return is
the episode's reward: a number, or a dict `{"reward": r, "turn_rewards": [one per call],
"metrics": {name: number}}` (reward defaults to the sum of turn_rewards).

Recording (`AgentRecord`, touched by one thread only: the host's loop). Each call's prompt is
rendered server side (the chat template applied once, to the whole message list) and becomes
token ids in one of two ways:
- it extends the previous call: its text starts with that call's prompt text plus the text of
  one of its choices. Then its ids are that call's prompt ids, that choice's sampled ids, and
  the tokens of the new text after it (a tool result, the next generation prompt). A sampled
  EOS stays when the new text writes the EOS token's text next (a template that closes the
  assistant turn with it); otherwise it is dropped, and the new text follows the tokens before
  it. So the model sees, and the learner trains on, exactly the sampled tokens, never a
  re-tokenisation of their text.
- otherwise (the agent edited or truncated the history, or a template rewrites earlier turns)
  the text is tokenised afresh and the call starts a new chain.
The episode trains on its final chain (the one ending at its last call): one sequence whose
loss mask is 1 exactly on the model's kept tokens, as a multi-turn episode's (envs/episode.py).
Calls outside it (earlier chains, choices no later call continued) are not trained; they are
counted (`dropped_calls`), and an episode with more than one chain is a fallback.

Stdlib only (the tokenizer is duck-typed): the learner evaluates agents with it too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollflash.envs.chat import encode_prompt
from rollflash.envs.episode import state_key
from rollflash.envs.user_code import import_function


class AgentLoadError(ValueError):
    """`rollout.agent` names nothing callable (one line, a config error)."""


@dataclass(frozen=True)
class Agent:
    spec: str  # "pkg.module:function"
    fn: Callable[..., Any]
    is_async: bool


def load_agent(spec: str) -> Agent:
    """The function `spec` names; AgentLoadError (one line) if it cannot be imported."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"rollout.agent: {spec!r} is not 'package.module:function'")
    fn = import_function(spec, "rollout.agent", AgentLoadError)
    return Agent(spec, fn, inspect.iscoroutinefunction(fn))


@dataclass(frozen=True)
class CallParams:
    """The sampling of one call, within the run's limits (envs/agent_protocol.py)."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Choice:
    ids: list[int]  # sampled tokens kept (cut before a stop string), EOS included if it stopped
    logprobs: list[float]  # behaviour log-probability of each
    versions: list[int]  # weight version of each
    text: str  # what the client got: the decoded ids without EOS
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    eos: bool  # ids end with the EOS token


@dataclass
class Call:
    prompt_text: str
    prompt_ids: list[int]
    choices: list[Choice]
    parent: tuple[int, int, int] | None  # (call, choice, its tokens kept here); None: new chain


class TextCodec(Protocol):
    """Text <-> token ids for the endpoint: `Codec`, or the sim engine's stand-in."""

    eos_id: int | None
    eos_text: str | None
    max_context: int | None

    def render_chat(self, messages: list[dict[str, Any]], tools: list | None) -> str: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode_more(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class Codec:
    """Text <-> token ids for the endpoint, over a Hugging Face tokenizer (duck-typed)."""

    def __init__(self, tokenizer: Any, template: str | None, max_context: int | None = None):
        self.tokenizer, self.template, self.max_context = tokenizer, template, max_context
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([self.eos_id]) if self.eos_id is not None else None

    def render_chat(self, messages: list[dict[str, Any]], tools: list | None) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def encode_prompt(self, text: str) -> list[int]:
        """A first prompt: the ids every single-turn prompt gets (envs/chat.py)."""
        return encode_prompt(self.tokenizer, text)

    def encode_more(self, text: str) -> list[int]:
        """Text that continues a context: no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Sequence:
    """An episode's final chain as one trajectory sample (module docstring)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_starts: list[int]  # response index where each call's kept tokens start
    turn_calls: list[int]  # the call index of each turn
    texts: list[str]
    finished: bool  # the last call stopped (EOS or a stop string)


@dataclass
class AgentRecord:
    """The calls of one episode (module docstring)."""

    codec: TextCodec
    calls: list[Call] = field(default_factory=list)

    def context(self, text: str | None, ids: list[int] | None) -> tuple[list[int], Any]:
        """The ids of a new prompt given as text (rendered) or as token ids, and its parent."""
        if self.calls:
            last = self.calls[-1]
            for k, choice in enumerate(last.choices):
                if ids is not None:
                    found = _extends_ids(last, choice, ids)
                else:
                    found = self._extends_text(last, choice, text or "")
                if found is not None:
                    context, kept = found
                    return context, (len(self.calls) - 1, k, kept)
        if ids is not None:
            return list(ids), None
        return self.codec.encode_prompt(text or ""), None

    def _extends_text(self, last: Call, choice: Choice, text: str) -> tuple[list[int], int] | None:
        head = last.prompt_text + choice.text
        if not text.startswith(head):
            return None
        rest, kept = text[len(head) :], len(choice.ids)
        if choice.eos:
            eos = self.codec.eos_text or ""
            if eos and rest.startswith(eos):
                rest = rest[len(eos) :]
            else:
                kept -= 1
        return last.prompt_ids + choice.ids[:kept] + self.codec.encode_more(rest), kept

    def chain_start(self, parent: Any) -> int:
        """Prompt length of the first call of the chain a new call with `parent` joins."""
        while parent is not None:
            call = self.calls[parent[0]]
            if call.parent is None:
                return len(call.prompt_ids)
            parent = call.parent
        return -1  # a new chain: its own prompt

    def sequence(self) -> Sequence | None:
        """The final chain (module docstring); None if no call was made."""
        if not self.calls:
            return None
        chain, chosen = [len(self.calls) - 1], [0]
        while self.calls[chain[0]].parent is not None:
            call, choice, kept = self.calls[chain[0]].parent  # type: ignore[misc]
            chain.insert(0, call)
            chosen.insert(0, choice)
        last = self.calls[chain[-1]]
        full = last.prompt_ids + last.choices[chosen[-1]].ids
        start = len(self.calls[chain[0]].prompt_ids)
        seq = Sequence(full[:start], full[start:], [], [], [], [], [], [], False)
        size = len(seq.response_ids)
        seq.loss_mask, seq.logprobs = [0] * size, [0.0] * size
        versions: list[int | None] = [None] * size
        for pos, (index, k) in enumerate(zip(chain, chosen)):
            call, choice = self.calls[index], self.calls[index].choices[k]
            later = self.calls[chain[pos + 1]].parent if pos + 1 < len(chain) else None
            kept = later[2] if later is not None else len(choice.ids)
            at = len(call.prompt_ids) - start
            seq.loss_mask[at : at + kept] = [1] * kept
            seq.logprobs[at : at + kept] = choice.logprobs[:kept]
            versions[at : at + kept] = choice.versions[:kept]
            if kept:
                seq.turn_starts.append(at)
                seq.turn_calls.append(index)
            seq.texts.append(choice.text)
        seq.versions = _filled(versions)
        seq.finished = last.choices[chosen[-1]].finish_reason == "stop"
        return seq

    @property
    def dropped_calls(self) -> int:
        """Calls whose tokens the final chain does not hold."""
        seq_calls, parent = 1, self.calls[-1].parent if self.calls else None
        while parent is not None:
            seq_calls += 1
            parent = self.calls[parent[0]].parent
        return len(self.calls) - seq_calls if self.calls else 0

    @property
    def chains(self) -> int:
        return sum(c.parent is None for c in self.calls)


def _extends_ids(last: Call, choice: Choice, ids: list[int]) -> tuple[list[int], int] | None:
    """Token prompts: the previous prompt, the choice's ids (with or without its EOS), more."""
    for kept in (len(choice.ids), len(choice.ids) - 1 if choice.eos else -1):
        head = last.prompt_ids + choice.ids[: max(kept, 0)]
        if kept >= 0 and ids[: len(head)] == head:
            return list(ids), kept
    return None


def _filled(values: list[int | None]) -> list[int]:
    """Per-token versions: a model token's own; any other token the version of the model token
    before it (the first model token's, before any)."""
    current = next((v for v in values if v is not None), 0)
    out = []
    for v in values:
        current = current if v is None else v
        out.append(current)
    return out


@dataclass
class Outcome:
    """What an episode's function returned, checked (a bad return is an agent error)."""

    reward: float = 0.0
    turn_rewards: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str = ""  # "", agent_error, agent_timeout, agent_bad_return, agent_no_call
    message: str = ""


def outcome_of(value: Any, calls: int) -> Outcome:
    """Check `run_episode`'s return (module docstring); `calls`: calls the episode made."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(Outcome(float(value)))
    if not isinstance(value, dict):
        return Outcome(failure="agent_bad_return", message=f"returned {type(value).__name__}")
    unknown = sorted(set(value) - {"reward", "turn_rewards", "metrics"})
    if unknown:
        return Outcome(failure="agent_bad_return", message=f"unknown key {unknown[0]!r}")
    turns = value.get("turn_rewards")
    if turns is not None and (
        not isinstance(turns, list)
        or len(turns) != calls
        or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in turns)
    ):
        return Outcome(
            failure="agent_bad_return", message=f"turn_rewards: not {calls} numbers (one a call)"
        )
    reward = value.get("reward", sum(turns) if turns else None)
    metrics = value.get("metrics") or {}
    if (
        not isinstance(reward, (int, float))
        or isinstance(reward, bool)
        or not isinstance(metrics, dict)
        or not all(isinstance(v, (int, float)) for v in metrics.values())
    ):
        return Outcome(failure="agent_bad_return", message="reward or metrics not numbers")
    return _finite(
        Outcome(
            float(reward),
            [float(t) for t in turns] if turns is not None else None,
            {str(k): float(v) for k, v in metrics.items()},
        )
    )


def _finite(out: Outcome) -> Outcome:
    if math.isfinite(out.reward) and all(math.isfinite(t) for t in out.turn_rewards or []):
        return out
    return Outcome(failure="agent_bad_return", message="reward not finite")


def turn_rewards(outcome: Outcome, seq: Sequence) -> list[float]:
    """The reward of each turn of the trained chain: the agent's per-call rewards when it gave
    them, else the episode's reward on the last turn."""
    if outcome.turn_rewards is not None:
        return [outcome.turn_rewards[i] for i in seq.turn_calls]
    return [0.0] * (len(seq.turn_starts) - 1) + [outcome.reward]


def turn_states(record: AgentRecord, seq: Sequence) -> list[int]:
    """A state key per turn: a hash of the whole context the call was sampled from."""
    return [state_key(record.calls[i].prompt_text) for i in seq.turn_calls]
