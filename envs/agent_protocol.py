"""The OpenAI request and response bodies the agent endpoint speaks (envs/agent_server.py).

Honoured, within the run's limits (`Limits`):
- `messages` (chat): roles and text content (a string, or a list of `{"type": "text"}` parts),
  an assistant's `tool_calls`, a tool message's `tool_call_id`, and the request's `tools`: all
  handed to the model's chat template, which decides how they are written. The response's
  message holds the model's text as `content`; the endpoint parses no tool calls out of it
  (`tool_calls` is never set): the agent reads its model's own syntax.
- `prompt` (completions): one string, or one list of token ids (used as they are).
- `max_tokens` / `max_completion_tokens`: capped at rollout.max_new_tokens and at what is left
  of the episode's token budget (rollout.max_episode_tokens) and of the model's context.
- `temperature` (> 0; default rollout.temperature) and `top_p` (default rollout.top_p): the
  behaviour log-probabilities are those of the distribution sampled from. The learner scores
  tokens at rollout.temperature, so another temperature is off-policy data to it (its ratio
  corrections apply). Evaluation is greedy whatever the request says.
- `n` (1 .. rollout.num_return_sequences): that many choices of one prompt.
- `stop` (a string or up to 4): the choice is cut before the first token whose text reaches
  a stop string; the text returned is that of the tokens kept, so a later prompt that repeats
  it extends the call. Sampling runs on to EOS or max_tokens and the cut tokens are discarded
  (never trained).
- `return_token_ids: true` (vLLM's name): the response also carries `prompt_token_ids` and each
  choice's `token_ids`.
- `stream: true`: the whole answer as one server-sent event (a `chat.completion.chunk` or
  `text_completion` chunk holding every choice's text and finish reason; with
  `stream_options: {include_usage: true}` a usage chunk after it), then `data: [DONE]`: the
  engine batch decodes a call to its end, so there is nothing to send earlier.
Refused (400, OpenAI's error body): a bad type or range of the above (NaN and infinities
included), content other than text. Any other field (`model`, `seed`, `logprobs`, penalties,
`tool_choice`, ...) is accepted and ignored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from rollflash.envs.agent import CallParams, Choice


class RequestError(ValueError):
    """A request the endpoint refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400):  # fmt: skip
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.param, self.code)


def error_body(message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }  # fmt: skip
    }


@dataclass(frozen=True)
class Limits:
    """The run's bounds on a call (rollout.*); `greedy`: evaluation, temperature ignored."""

    max_new_tokens: int
    max_episode_tokens: int
    temperature: float
    top_p: float
    max_n: int
    timeout_s: float
    greedy: bool = False

    @classmethod
    def of(cls, rollout: Any, max_new_tokens: int | None = None, greedy: bool = False) -> Limits:
        """A run's `rollout:` section's limits (`max_new_tokens`: a domain's own)."""
        return cls(
            max_new_tokens=max_new_tokens or rollout.max_new_tokens,
            max_episode_tokens=rollout.max_episode_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            max_n=rollout.num_return_sequences,
            timeout_s=rollout.agent_timeout_s,
            greedy=greedy,
        )


def _number(body: dict, key: str, default: float, low: float, high: float, open_low: bool):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key}: expected a number, got {value!r:.40}", key)
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison
        raise RequestError(f"{key}: must be a finite number, got {value}", key)
    if value > high or value < low or (open_low and value == low):
        side = ">" if open_low else ">="
        raise RequestError(f"{key}: must be {side} {low} and <= {high}, got {value}", key)
    return float(value)


def _integer(body: dict, key: str, default: int, low: int, high: int | None = None) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key}: expected an integer >= {low}, got {value!r:.40}", key)
    if high is not None and value > high:
        raise RequestError(f"{key}: at most {high} in this run, got {value}", key)
    return value


def params_of(body: dict[str, Any], limits: Limits) -> CallParams:
    """The sampling a request asks for, checked; max_tokens still uncapped by the budget."""
    n = _integer(body, "n", 1, 1, limits.max_n)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = min(_integer(body, key, limits.max_new_tokens, 1), limits.max_new_tokens)
    if limits.greedy:
        temperature = 1.0  # unused: evaluation decodes greedily
    else:
        temperature = _number(body, "temperature", limits.temperature, 0.0, 1e3, open_low=True)
    top_p = _number(body, "top_p", limits.top_p, 0.0, 1.0, open_low=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError("stop: a non-empty string or a list of up to 4", "stop")
    return CallParams(n, temperature, top_p, max_tokens, tuple(stops))


def messages_of(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list | None]:
    """The chat messages (None-valued keys dropped, text parts joined) and the tools."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list is required", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: a mapping with a string role", "messages")
        m = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts", "messages")
            m["content"] = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: text expected", "messages")
        out.append(m)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools: a list is required", "tools")
    return out, tools or None


def prompt_of(body: dict[str, Any], vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    """A completions prompt: (text, None) or (None, token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab_size or 2**31)
            for t in prompt
        )
    ):
        return None, list(prompt)
    raise RequestError(
        "prompt: one non-empty string or one list of token ids in the vocabulary", "prompt"
    )


def response(
    kind: str, call_id: str, model: str, prompt_ids: list[int], choices: list[Choice],
    with_ids: bool,
) -> dict[str, Any]:  # fmt: skip
    """The chat.completion or text_completion object of one answered call."""
    out_choices = []
    for i, c in enumerate(choices):
        if kind == "chat":
            choice: dict[str, Any] = {"index": i, "message": {"role": "assistant",
                                      "content": c.text}}  # fmt: skip
        else:
            choice = {"index": i, "text": c.text}
        choice.update(finish_reason=c.finish_reason, logprobs=None)
        if with_ids:
            choice["token_ids"] = list(c.ids)
        out_choices.append(choice)
    completion = sum(len(c.ids) for c in choices)
    body: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out_choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        },
    }
    if with_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def stream_events(kind: str, body: dict[str, Any], with_usage: bool) -> list[dict[str, Any]]:
    """A `response` body as the chunks of a streamed answer (module docstring)."""
    chunk = {k: body[k] for k in ("id", "created", "model")}
    chunk["object"] = "chat.completion.chunk" if kind == "chat" else "text_completion"
    choices = []
    for c in body["choices"]:
        out = {"index": c["index"], "finish_reason": c["finish_reason"], "logprobs": None}
        if kind == "chat":
            out["delta"] = {"role": "assistant", "content": c["message"]["content"]}
        else:
            out["text"] = c["text"]
        if "token_ids" in c:
            out["token_ids"] = c["token_ids"]
        choices.append(out)
    events = [{**chunk, "choices": choices}]
    if with_usage:
        events.append({**chunk, "choices": [], "usage": body["usage"]})
    return events
