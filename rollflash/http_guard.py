"""What keeps the project's HTTP servers from being starved: the weight server of the learner's
publishing process and of every relaying generator (broker/weights/weight_server.py), and the agent
endpoint (envs/agent_server.py). Both are aiohttp applications; this module is how they listen.

aiohttp parses requests, bounds the request line and headers (8 KiB each, 128 headers), bodies
(`client_max_size`) and, with `keepalive_timeout`, closes a connection that holds no complete
request that long after its previous answer. It has no cap on connections, and how it treats a
connection's *first* request has changed between releases. So 1,100 clients that each send part
of a request line would hold 1,100 descriptors (EMFILE: nothing else is accepted) for as long as
they like. A `GuardedListener` closes that gap with asyncio's own server, whose protocol factory
hands aiohttp's (`web.Server`, documented as a protocol factory) each connection it admits:

- **caps**: a connection over `max_connections_per_peer` from its address, or over
  `max_connections` in all, is reset as soon as it is accepted (its descriptor is free at once);
  the caps are counted at TCP level, before any TLS handshake, so a handshake that never ends
  counts too. `max_connections` is kept `RESERVED_FDS` below the process's descriptor limit;
- **headers**: a connection whose first request's headers have not all arrived within
  `request_timeout_s` of its accept (TLS handshake included) is reset, however it trickles
  bytes; later requests on it get the same bound from aiohttp's `keepalive_timeout`;
- **bodies**: `read_json` reads a body within `request_timeout_s` (408 after), and parses it
  refusing invalid UTF-8, invalid JSON and nesting past the interpreter's recursion limit (400),
  never a traceback;
- **logs**: a refused connection or request is one line with no traceback, at most `BURST` per
  reason per `LOG_EVERY_S` and then a count (`Throttle`), so a flood cannot fill the logs;
  aiohttp's own 4xx refusals (a malformed request line) go through it too (`OneLineLog`).

Why this and not something else: a cap needs to see connections before aiohttp does, and the
asyncio protocol factory is the one documented place for it; the TLS handshake is started here
(`loop.start_tls`) rather than by `create_server(ssl=...)`, which would hand over a connection
only after its handshake and so leave handshakes uncounted. Nothing here parses HTTP but the
search for the end of the first request's headers. Stdlib only (aiohttp is the caller's), so
both broker/ and envs/ may import it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

RESERVED_FDS = 128  # descriptors left to the process (files, Redis, zmq) below its limit
LOG_EVERY_S = 10.0  # refusals of one kind are logged at most BURST times in this long
BURST = 10
_HEADERS_END = (b"\r\n\r\n", b"\n\n")


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts; a connection beyond either cap is reset at once."""

    request_timeout_s: float = 10.0  # headers (from accept or the last answer), then a body
    max_connections: int = 1024  # open connections in all
    max_connections_per_peer: int = 256  # open connections from one address

    def within_descriptors(self) -> ServerLimits:
        """These limits with `max_connections` under the process's descriptor limit."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or self.max_connections <= soft - RESERVED_FDS:
            return self
        most = max(1, soft - RESERVED_FDS)
        log.warning(
            "at most %d connections (not %d): this process may open %d descriptors "
            "(ulimit -n); raise it to accept more",
            most,
            self.max_connections,
            soft,
        )
        return replace(self, max_connections=most)


class Throttle:
    """Refusals, logged one line each, but at most `BURST` lines per reason per `LOG_EVERY_S`:
    the rest are counted and the count is given on the next line of that reason. Reasons are a
    fixed set of phrases (what varies goes in `detail`), so memory stays flat."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, name: str):
        self.logger, self.name = logger, name
        self._window: dict[str, tuple[float, int]] = {}  # reason -> (window start, lines in it)
        self._unlogged: Counter[str] = Counter()

    def note(self, reason: str, detail: str = "") -> None:
        now = time.monotonic()
        start, lines = self._window.get(reason, (now, 0))
        if now - start >= LOG_EVERY_S:
            start, lines = now, 0
        if lines >= BURST:
            self._unlogged[reason] += 1
            self._window[reason] = (start, lines)
            return
        self._window[reason] = (start, lines + 1)
        more = self._unlogged.pop(reason, 0)
        self.logger.warning(
            "%s: %s%s%s",
            self.name,
            reason,
            f": {detail}" if detail else "",
            f" ({more} more not logged)" if more else "",
        )

    def refused(self, request: Any, why: str) -> None:
        """An aiohttp request refused with a 4xx, because `why`."""
        self.note("refused a request", f"{request.method} {request.path[:120]}: {why}")


class OneLineLog(logging.LoggerAdapter):
    """aiohttp's server logger (`logger=`): a request its parser refused (a client's fault, an
    exception with a 4xx `code`) is one throttled line without a traceback; anything else keeps
    its traceback, since it is a bug."""

    def __init__(self, logger: logging.Logger, name: str):
        super().__init__(logger, {})
        self.refusals = Throttle(logger, name)

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        code = getattr(exc_info, "code", None)
        if isinstance(code, int) and 400 <= code < 500:
            self.refusals.note("refused a malformed request", f"{code} {_one_line(exc_info)}")
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


class BadBody(ValueError):
    """A request body that cannot be used; `status` is the 4xx to answer."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


async def read_json(request: Any, timeout_s: float) -> Any:
    """The JSON value of an aiohttp request's body, read within `timeout_s` (its size is bounded
    by the application's `client_max_size`: aiohttp answers 413)."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadBody(408, f"the body did not arrive within {timeout_s:g}s") from None
    except Exception as e:  # aiohttp's 413 (HTTPRequestEntityTooLarge) past client_max_size
        if getattr(e, "status_code", None) == 413:
            raise BadBody(413, _one_line(ValueError(getattr(e, "text", "too large")))) from None
        raise
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON; BadBody(400) naming why not (invalid UTF-8 or JSON, nested too deeply)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadBody(400, "the JSON is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise BadBody(400, f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise BadBody(400, f"the body is not JSON ({_one_line(e)})") from None


def runner_options(limits: ServerLimits, logger: logging.Logger, name: str) -> dict[str, Any]:
    """aiohttp's `web.AppRunner` options that go with a `GuardedListener` of `limits`: a later
    request's headers within `request_timeout_s` of the previous answer (`keepalive_timeout`),
    a body the handler left unread drained for at most that long, no access log, and the
    parser's refusals in one line each (`OneLineLog`)."""
    return {
        "keepalive_timeout": limits.request_timeout_s,
        "lingering_time": limits.request_timeout_s,
        "access_log": None,
        "logger": OneLineLog(logger, name),
    }


def _one_line(e: BaseException) -> str:
    text = str(getattr(e, "message", None) or e)
    return " ".join(text.split())[:200] or type(e).__name__


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class GuardedListener:
    """Listens on (host, port) and hands each admitted connection to `factory()` (an aiohttp
    `web.Server`, or any protocol factory), over TLS with `ssl_context`. Runs in one loop."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limits: ServerLimits,
        name: str,
        ssl_context: ssl.SSLContext | None = None,
        logger: logging.Logger = log,
    ):
        self.factory, self.limits, self.ssl = factory, limits.within_descriptors(), ssl_context
        self.refusals = Throttle(logger, name)
        self.total = 0
        self.per_peer: Counter[str] = Counter()
        self.guards: set[_Guard] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and listen; returns the bound (host, port)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Guard(self), host, port, backlog=512)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        """Stop listening and reset the connections not yet handed to `factory`."""
        if self._server is not None:
            self._server.close()
        for guard in list(self.guards):
            guard.abort_if_unhanded()

    def admit(self, peer: str) -> str | None:
        """Count a new connection from `peer`; or say why it is refused."""
        lim = self.limits
        if self.total >= lim.max_connections:
            return f"over {lim.max_connections} connections in all"
        if self.per_peer[peer] >= lim.max_connections_per_peer:
            return f"over {lim.max_connections_per_peer} connections from {peer}"
        self.total += 1
        self.per_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]


class _Guard(asyncio.Protocol):
    """One connection: counted, timed until its first request's headers, then a pass-through
    to the protocol `factory` made (aiohttp's request handler)."""

    def __init__(self, listener: GuardedListener):
        self.listener = listener
        self.inner: asyncio.Protocol | None = None
        self.raw: asyncio.Transport | None = None
        self.peer = ""
        self.open = False
        self.early: list[bytes] = []  # bytes decrypted before the handler was made (TLS)
        self.tail = b""  # the end of what came so far, while looking for the headers' end
        self.deadline: asyncio.TimerHandle | None = None
        self.tls_task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw: Any = transport
        self.peer = _peer(raw)
        refused = self.listener.admit(self.peer)
        if refused is not None:
            self.listener.refusals.note("refused connections", refused)
            raw.abort()
            return
        self.raw, self.open = raw, True
        self.listener.guards.add(self)
        loop = asyncio.get_running_loop()
        self.deadline = loop.call_later(self.listener.limits.request_timeout_s, self._too_slow)
        if self.listener.ssl is None:
            self._hand_over(raw)
        else:
            raw.pause_reading()  # until start_tls has put its TLS layer in front of us
            self.tls_task = loop.create_task(self._start_tls(raw, self.listener.ssl))

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.listener.limits.request_timeout_s
        try:
            tls = await loop.start_tls(
                raw, self, context, server_side=True, ssl_handshake_timeout=timeout
            )
        except Exception as e:  # reset, timed out, not TLS: whatever it is, the connection ends
            self.listener.refusals.note("failed TLS handshakes", _one_line(e))
            tls = None
        if tls is None:
            raw.abort()
            self._closed()
        elif self.open:
            self._hand_over(tls)

    def _hand_over(self, transport: asyncio.BaseTransport) -> None:
        self.inner = self.listener.factory()
        self.inner.connection_made(transport)
        early, self.early = self.early, []
        for data in early:
            self.inner.data_received(data)

    def _too_slow(self) -> None:
        self.deadline = None
        limit = self.listener.limits.request_timeout_s
        self.listener.refusals.note(
            "closed connections that sent no complete request headers", f"within {limit:g}s"
        )
        if self.raw is not None:
            self.raw.abort()

    def abort_if_unhanded(self) -> None:
        if self.inner is None and self.raw is not None:
            self.raw.abort()

    def data_received(self, data: bytes) -> None:
        if self.deadline is not None:
            seen = self.tail + data
            if any(end in seen for end in _HEADERS_END):
                self.deadline.cancel()
                self.deadline, self.tail = None, b""
            else:
                self.tail = seen[-3:]
        if self.inner is None:
            self.early.append(data)
        else:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def _closed(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.open:
            self.open = False
            self.listener.guards.discard(self)
            self.listener.release(self.peer)
