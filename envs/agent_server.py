"""The OpenAI-compatible HTTP endpoint agent programs call (aiohttp, `pip install
'rollflash[agent]'`).

    POST /episodes/{token}/v1/chat/completions
    POST /episodes/{token}/v1/completions
    GET  /episodes/{token}/v1/models

It listens on 127.0.0.1 on a free port, in a thread of its own with its own event loop. Each
episode has a random token in its base URL (an agent's client is made with it), so a call is
tied to its episode; a call for a token that is not open (never was, or its episode ended) gets
404, before its body is read. The server does no model work: it puts each parsed request on
`inbox` as a `Pending` and waits for `reply`, which the host's loop (envs/agent_host.py) calls
from its own thread once the engine has answered. Bodies over 16 MiB are refused by aiohttp
(413); a body that is not a JSON object (invalid UTF-8 or JSON, nested past the interpreter's
recursion limit) gets 400, and one that does not arrive within `LIMITS.request_timeout_s` 408,
each with one log line.

It listens through a `GuardedListener` (rollflash/http_guard.py): a connection that sends no
complete request headers within `LIMITS.request_timeout_s` is closed, and at most
`LIMITS.max_connections` are open (every caller is on this host, so one address: the cap per
peer is the same). Above the connections an episode's client opens, which the generator's
concurrency bounds (openai's pool keeps at most 1,000).

aiohttp is imported when the server starts, so envs/ stays importable without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from rollflash.envs.agent_protocol import error_body, stream_events
from rollflash.http_guard import (
    BadBody,
    GuardedListener,
    ServerLimits,
    Throttle,
    read_json,
    runner_options,
)

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20
LIMITS = ServerLimits(request_timeout_s=30.0, max_connections=2048, max_connections_per_peer=2048)
_ROUTES = {"chat/completions": "chat", "completions": "completion"}


def import_aiohttp() -> Any:
    try:
        from aiohttp import web
    except ImportError:
        raise ValueError(
            "rollout.agent: the endpoint needs aiohttp and openai; pip install 'rollflash[agent]'"
        ) from None
    return web


@dataclass
class Pending:
    """One request waiting for its answer."""

    token: str
    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    future: Any  # asyncio.Future of (status, body), on the server's loop


class AgentServer:
    """The endpoint (module docstring); `inbox` receives ("call", Pending) events."""

    def __init__(self, inbox: queue.Queue, model_name: str = "rollflash", host: str = "127.0.0.1",
                 limits: ServerLimits = LIMITS):  # fmt: skip
        self.web = import_aiohttp()
        self.inbox, self.model_name, self.host = inbox, model_name, host
        self.limits = limits
        self.refusals = Throttle(log, "agent endpoint")
        self.tokens: set[str] = set()  # open episodes; read by the server thread
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True, name="agent-server")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def base_url(self, token: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{token}/v1"

    def open(self, token: str) -> None:
        self.tokens.add(token)

    def close_episode(self, token: str) -> None:
        self.tokens.discard(token)

    def reply(self, pending: Pending, status: int, body: dict[str, Any]) -> None:
        """Answer `pending` (from any thread); a request whose client left is dropped."""

        def resolve() -> None:
            if not pending.future.done():
                pending.future.set_result((status, body))

        self.loop.call_soon_threadsafe(resolve)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    # -- the server thread ------------------------------------------------------------------------

    def _main(self) -> None:
        web = self.web
        self.loop = asyncio.new_event_loop()
        try:
            app = web.Application(client_max_size=MAX_BODY)
            for path, kind in _ROUTES.items():
                app.router.add_post(f"/episodes/{{token}}/v1/{path}", self._handler(kind))
            app.router.add_get("/episodes/{token}/v1/models", self._models)
            runner = web.AppRunner(app, **runner_options(self.limits, log, "agent endpoint"))
            self.loop.run_until_complete(runner.setup())
            listener = GuardedListener(runner.server, self.limits, "agent endpoint")
            self.listener = listener
            self.port = self.loop.run_until_complete(listener.start(self.host, 0))[1]
        except BaseException as e:  # reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            listener.close()
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

    def _closed(self, token: str) -> Any:
        return self.web.json_response(
            error_body(f"episode {token!r} is not open (it ended, or never was)", None,
                       "episode_closed"),
            status=404,
        )  # fmt: skip

    def _refuse(self, request: Any, status: int, why: str) -> Any:
        """A 4xx in the API's error form, logged in one (throttled) line."""
        self.refusals.refused(request, why)
        return self.web.json_response(error_body(why), status=status)

    def _handler(self, kind: str):
        web = self.web

        async def handle(request: Any) -> Any:
            token = request.match_info["token"]
            if token not in self.tokens:
                return self._closed(token)
            try:
                body = await read_json(request, self.limits.request_timeout_s)
            except BadBody as e:
                return self._refuse(request, e.status, str(e))
            if not isinstance(body, dict):
                return self._refuse(request, 400, "the body is not a JSON object")
            future = asyncio.get_running_loop().create_future()
            self.inbox.put(("call", Pending(token, kind, body, future)))
            status, out = await future
            if status != 200 or not body.get("stream"):
                return web.json_response(out, status=status)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            for event in stream_events(kind, out, usage):
                await stream.write(f"data: {json.dumps(event)}\n\n".encode())
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
            return stream

        return handle

    async def _models(self, request: Any) -> Any:
        token = request.match_info["token"]
        if token not in self.tokens:
            return self._closed(token)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollflash"}
        return self.web.json_response({"object": "list", "data": [model]})
