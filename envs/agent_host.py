"""Runs agent episodes and answers their model calls in shared engine batches.

    host = AgentHost(load_agent("pkg.mod:run_episode"), codec, limits)
    run  = host.start(item, key)                   # the agent starts in a thread (or a coroutine)
    host.serve(until, generate, on_finish, on_step)
    host.close()

Each episode's function runs with its own client (openai.OpenAI for a plain function, in a
thread of its own; openai.AsyncOpenAI on one shared event loop for an `async def`), whose base
URL names the episode (envs/agent_server.py). The clients share one connection pool: building an
HTTP client (its TLS context) costs about 0.1 s, which per episode would dwarf the calls.
The agent's code is the user's and is trusted: it runs in this process,
not in the sandbox (a model's code it runs should go through envs/sandbox.py).

`serve` is this process's loop, and the only code that touches the engine and the records: it
gathers the calls that are waiting (while some episode is busy in its own code, until no call
came for GATHER_S, as the multi-turn runner does), renders and tokenises them (envs/agent.py), runs one
`generate(prompts, params)` per distinct sampling, records each choice and answers it; then calls
`on_step` (the generator checks for new weights there, in interrupt mode). An episode ends when
its function returns, raises, or runs past `limits.timeout_s`: `on_finish(run)` then sees
`run.outcome`. None of these stops the loop: a raise, a bad return value or a timeout is
`outcome.failure` (agent_error, agent_bad_return, agent_timeout; reward 0), an episode that made
no call is agent_no_call, and the first of each is logged with its reason. A timed-out
coroutine is cancelled; a timed-out thread cannot be, and its next call gets 404. `cancel(run)`
ends an episode whose result is no longer wanted (redundant samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollflash.envs.agent import (
    Agent,
    AgentRecord,
    Call,
    CallParams,
    Choice,
    Outcome,
    TextCodec,
    outcome_of,
)
from rollflash.envs.agent_protocol import (
    Limits,
    RequestError,
    error_body,
    messages_of,
    params_of,
    prompt_of,
    response,
)
from rollflash.envs.agent_server import AgentServer, Pending

log = logging.getLogger(__name__)

# while some episodes run their own code, wait for more calls until none came for GATHER_S
# (calls answered together come back spread over a few ms of HTTP), at most GATHER_MAX_S
GATHER_S = 0.005
GATHER_MAX_S = 0.05
_COUNTERS = {
    "agent_error": "errors",
    "agent_timeout": "timeouts",
    "agent_bad_return": "bad_returns",
    "agent_no_call": "no_calls",
}
# the openai client's transport logs every request at INFO: one line per model call
_CHATTY = ("httpx", "httpx2", "openai")
Generate = Callable[[list[list[int]], CallParams], list[list[Any]]]  # -> samples per prompt


@dataclass
class Run:
    """One episode in flight."""

    key: Any  # the caller's (a group index)
    item: Any
    token: str
    record: AgentRecord
    deadline: float
    waiting: int = 0  # its calls not yet answered
    done: bool = False
    cancelled: bool = False
    outcome: Outcome | None = None
    future: Any = None  # an async agent's concurrent.futures.Future


@dataclass
class _Entry:
    run: Run
    pending: Pending
    text: str
    context: list[int]
    parent: Any
    params: CallParams


@dataclass
class AgentCounters:
    """What the hosts's episodes did (the generator's heartbeat shows them)."""

    counts: Counter = field(default_factory=Counter)
    metric_sums: Counter = field(default_factory=Counter)

    def fields(self) -> dict[str, float]:
        out: dict[str, float] = {f"agent_{k}": v for k, v in sorted(self.counts.items())}
        episodes = self.counts["episodes"] or 1
        for name, total in sorted(self.metric_sums.items()):
            out[f"agent_metric_{name}"] = round(total / episodes, 4)
        return out


class AgentHost:
    """See the module docstring."""

    def __init__(self, agent: Agent, codec: TextCodec, limits: Limits, vocab_size: int | None = None,
                 version: Callable[[], int] = lambda: 0, model_name: str = "rollflash"):  # fmt: skip
        self.agent, self.codec, self.limits = agent, codec, limits
        self.vocab_size, self.version = vocab_size, version
        self.inbox: queue.Queue = queue.Queue()
        self.server = AgentServer(self.inbox, model_name)
        self.runs: dict[str, Run] = {}
        self.counters = AgentCounters()
        self._logged: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._http: Any = None  # the shared connection pools (sync, async)
        self._ahttp: Any = None
        for name in _CHATTY:
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))

    # -- episodes ---------------------------------------------------------------------------------

    def start(self, item: Any, key: Any) -> Run:
        token = secrets.token_hex(8)
        run = Run(
            key, item, token, AgentRecord(self.codec), time.monotonic() + self.limits.timeout_s
        )
        self.runs[token] = run
        self.server.open(token)
        url = self.server.base_url(token)
        if self.agent.is_async:
            run.future = asyncio.run_coroutine_threadsafe(self._async_main(run, url), self._aloop())
        else:
            threading.Thread(
                target=self._sync_main, args=(run, url), daemon=True, name="agent"
            ).start()
        return run

    def _sync_main(self, run: Run, url: str) -> None:
        try:
            import openai

            with self._lock:  # one connection pool for every episode's client (module docstring)
                if self._http is None:
                    self._http = openai.DefaultHttpxClient()
            client = openai.OpenAI(base_url=url, api_key="rollflash", max_retries=0,
                                   timeout=self.limits.timeout_s, http_client=self._http)  # fmt: skip
            self.inbox.put(("done", run, self.agent.fn(client, run.item)))
        except BaseException as e:  # the agent's, reported by the loop
            self.inbox.put(("error", run, e))

    async def _async_main(self, run: Run, url: str) -> None:
        try:
            import openai

            if self._ahttp is None:  # on the agents' loop, so no lock
                self._ahttp = openai.DefaultAsyncHttpxClient()
            client = openai.AsyncOpenAI(base_url=url, api_key="rollflash", max_retries=0,
                                        timeout=self.limits.timeout_s, http_client=self._ahttp)  # fmt: skip
            self.inbox.put(("done", run, await self.agent.fn(client, run.item)))
        except BaseException as e:  # CancelledError included: the loop ignores a cancelled run
            self.inbox.put(("error", run, e))

    def _aloop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="agents").start()
        return self._loop

    def cancel(self, run: Run) -> None:
        """End an episode whose result is not wanted; its later calls get 404."""
        if not run.done:
            run.done = run.cancelled = True
            self._close(run)

    def _close(self, run: Run) -> None:
        self.server.close_episode(run.token)
        self.runs.pop(run.token, None)
        if run.future is not None:
            run.future.cancel()

    def close(self) -> None:
        for run in list(self.runs.values()):
            self.cancel(run)
        self.server.stop()
        if self._http is not None:
            self._http.close()
        if self._loop is not None:
            if self._ahttp is not None:  # best effort: a stuck agent may hold the loop
                closing = asyncio.run_coroutine_threadsafe(self._ahttp.aclose(), self._loop)
                with contextlib.suppress(Exception):
                    closing.result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- the loop ---------------------------------------------------------------------------------

    def serve(
        self,
        until: Callable[[], bool],
        generate: Generate,
        on_finish: Callable[[Run], None] = lambda run: None,
        on_step: Callable[[], object] | None = None,
    ) -> None:
        """Answer calls and end episodes until `until()` (module docstring)."""
        while not until():
            batch: list[_Entry] = []
            for event in self._gather():
                if event[0] == "call":
                    self._prepare(event[1], batch)
                else:
                    run = event[1]
                    self._finish(run, value=event[2] if event[0] == "done" else None,
                                 error=event[2] if event[0] == "error" else None,
                                 on_finish=on_finish)  # fmt: skip
            now = time.monotonic()
            for run in [r for r in self.runs.values() if now > r.deadline]:
                self._finish(run, timed_out=True, on_finish=on_finish)
            if batch:
                self._answer(batch, generate)
                if on_step is not None:
                    on_step()

    def _gather(self) -> list[tuple]:
        nearest = min((r.deadline for r in self.runs.values()), default=time.monotonic() + 1)
        try:
            events = [self.inbox.get(timeout=max(0.0, min(1.0, nearest - time.monotonic())))]
        except queue.Empty:
            return []
        first = time.monotonic()
        deadline = first + GATHER_S
        while True:
            try:
                events.append(self.inbox.get_nowait())
                deadline = min(first + GATHER_MAX_S, time.monotonic() + GATHER_S)
                continue
            except queue.Empty:
                pass
            calls = sum(e[0] == "call" for e in events)
            busy = sum(not r.waiting for r in self.runs.values()) - calls
            left = deadline - time.monotonic()
            if busy <= 0 or left <= 0:
                return events
            try:
                events.append(self.inbox.get(timeout=left))
                deadline = min(first + GATHER_MAX_S, time.monotonic() + GATHER_S)
            except queue.Empty:
                return events

    def _prepare(self, pending: Pending, batch: list[_Entry]) -> None:
        """Render, tokenise and bound one call, or answer it with an error at once."""
        run = self.runs.get(pending.token)
        if run is None or run.done:
            self.server.reply(pending, 404, error_body("the episode has ended", None,
                                                       "episode_closed"))  # fmt: skip
            return
        try:
            params = params_of(pending.body, self.limits)
            if pending.kind == "chat":
                text: str | None = self._render(*messages_of(pending.body))
                ids = None
            else:
                text, ids = prompt_of(pending.body, self.vocab_size)
            context, parent = run.record.context(text, ids)
            start = run.record.chain_start(parent) if parent is not None else len(context)
            room = self.limits.max_episode_tokens - (len(context) - start)
            if self.codec.max_context is not None:
                room = min(room, self.codec.max_context - len(context))
            if room < 1:
                raise RequestError(
                    f"no room for a completion: {len(context)} prompt tokens, the episode's "
                    f"budget of {self.limits.max_episode_tokens} response tokens "
                    f"(rollout.max_episode_tokens) or the model's context is spent",
                    "messages", "context_length_exceeded")  # fmt: skip
        except RequestError as e:
            self.server.reply(pending, e.status, e.body())
            return
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        text = text if text is not None else self.codec.decode(context)
        run.waiting += 1
        batch.append(_Entry(run, pending, text, context, parent, params))

    def _render(self, messages: list[dict], tools: list | None) -> str:
        try:
            return self.codec.render_chat(messages, tools)
        except Exception as e:  # the template's own errors (jinja2, a raise_exception call)
            raise RequestError(
                f"messages: the chat template refused them ({e})", "messages"
            ) from None

    def _answer(self, batch: list[_Entry], generate: Generate) -> None:
        by_params: dict[CallParams, list[_Entry]] = {}
        for entry in batch:
            by_params.setdefault(entry.params, []).append(entry)
        for params, entries in by_params.items():
            groups = generate([e.context for e in entries], params)
            for entry, samples in zip(entries, groups):
                choices = [self._choice(s, params) for s in samples]
                entry.run.waiting -= 1
                if not entry.run.done:
                    entry.run.record.calls.append(
                        Call(entry.text, entry.context, choices, entry.parent)
                    )
                self.counters.counts["calls"] += 1
                call_id = f"{entry.pending.kind}-{entry.run.token}-{len(entry.run.record.calls)}"
                with_ids = bool(entry.pending.body.get("return_token_ids"))
                body = response(entry.pending.kind, call_id, self.server.model_name,
                                entry.context, choices, with_ids)  # fmt: skip
                self.server.reply(entry.pending, 200, body)

    def _choice(self, sample: Any, params: CallParams) -> Choice:
        ids, logprobs = list(sample.response_ids), list(sample.logprobs)
        versions = list(sample.token_versions or [self.version()] * len(ids))
        eos = bool(ids) and ids[-1] == self.codec.eos_id
        body = ids[:-1] if eos else ids
        cut = self._stop_cut(body, params.stop) if params.stop else None
        if cut is not None:
            ids, logprobs, versions, eos = ids[:cut], logprobs[:cut], versions[:cut], False
            body = ids
        finish = "stop" if eos or cut is not None else "length"
        return Choice(ids, logprobs, versions, self.codec.decode(body), finish, eos)

    def _stop_cut(self, ids: list[int], stops: tuple[str, ...]) -> int | None:
        """How many tokens to keep: the most whose text stays before the first stop string."""
        full = self.codec.decode(ids)
        found = [full.find(s) for s in stops if s in full]
        if not found:
            return None
        before = full[: min(found)]
        low, high = 0, len(ids)  # decode(ids[:low]) is a prefix of `before`; ids[:high] is not
        while high - low > 1:
            mid = (low + high) // 2
            if before.startswith(self.codec.decode(ids[:mid])):
                low = mid
            else:
                high = mid
        return low

    def _finish(self, run: Run, value: Any = None, error: BaseException | None = None,
                timed_out: bool = False, on_finish: Callable[[Run], None] = lambda r: None):  # fmt: skip
        if run.done:
            return  # cancelled, or timed out before it returned
        run.done = True
        self._close(run)
        calls = len(run.record.calls)
        if timed_out:
            out = Outcome(failure="agent_timeout", message=f"over {self.limits.timeout_s}s")
        elif error is not None:
            out = Outcome(failure="agent_error", message=f"{type(error).__name__}: {error}")
        else:
            out = outcome_of(value, calls)
            if not out.failure and not calls:
                out.failure, out.message = "agent_no_call", "returned without calling the model"
        run.outcome = out
        c = self.counters.counts
        c["episodes"] += 1
        c["fallbacks"] += run.record.chains > 1
        c["dropped_calls"] += run.record.dropped_calls
        if out.failure:
            c[_COUNTERS[out.failure]] += 1
            if out.failure not in self._logged:
                self._logged.add(out.failure)
                log.warning("agent %s: %s in episode of item %s: %s (first of its kind)",
                            self.agent.spec, out.failure, getattr(run.item, "id", "?"),
                            out.message, exc_info=error)  # fmt: skip
        self.counters.metric_sums.update(out.metrics)
        on_finish(run)
