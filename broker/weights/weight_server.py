"""Serving weight versions over HTTP, read-only (`weights.transport: http`), with aiohttp.

The learner's publishing process serves its store; a relaying generator serves the versions it
fetches, from the moment it starts fetching them. Routes (every request must carry the run's
token, `Authorization: Bearer <token>`, compared in constant time; 401 otherwise, before any
body is read):
- `GET /v/{version}/manifest.json`: the manifest's bytes, as the learner wrote them;
- `GET /v/{version}/{file}`: a file of the version, whole or as `Range: bytes=a-b` (206); a relay
  has only the files of the form it fetched (a full file or a delta), 404 for the others. A relay
  answers a range only once it has verified every chunk the range touches, waiting up to
  `RELAY_WAIT_S` for its own fetch to get there (503 if that fetch failed or took longer);
- `POST /v/{version}/source` (the learner's server): the holder the asking generator should
  fetch a version this server holds from (broker/weights/weight_plan.py), body `{"relay", "failed"}`.
  Only from the generator named in the request's headers, proven by the key it registered with
  its own Redis credentials, offering as relay only the address it registered there
  (broker/weights/weight_auth.py; 403 otherwise);
- `GET /stats`: the bytes of file data served per version (the learner's egress).

It listens through a `GuardedListener` (rollflash/http_guard.py, `ServerLimits` from the
`weights:` section): connections are capped per peer and in all, and one that sends no complete
request headers within `weights.request_timeout_s` is closed, so clients without the token
cannot starve it of descriptors. A malformed request (a version of more than `MAX_VERSION_DIGITS`
digits, a body that is not a bounded JSON object) gets a 4xx and one log line.

What is served is opened without following links, relative to the version directory (a store's
`open_version`), and sent from that descriptor (sendfile, through /proc/self/fd), so a link
planted in a store never makes the server send a file from elsewhere. Integrity does not depend
on the server: a reader checks every chunk against the manifest the learner announced in Redis.
The server runs its own event loop in a thread (`start`, `close`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import ssl
import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

from rollflash.broker.weights.manifest import KIND_FILES, CorruptWeights, Manifest
from rollflash.broker.weights.weight_plan import SourcePlanner
from rollflash.broker.weights.weight_sources import Registrations, SourceDesk
from rollflash.broker.weights.weights import WeightStore
from rollflash.http_guard import GuardedListener, ServerLimits, Throttle, runner_options

log = logging.getLogger(__name__)

RELAY_WAIT_S = 60.0  # longest a relay holds a request for chunks its own fetch has not verified
SERVABLE = {name for names in KIND_FILES.values() for name in names}
MAX_VERSION_DIGITS = 18  # a version is a step count: 10^18 steps is beyond any run
MAX_BODY = 64 << 10  # a request for a source is a few hundred bytes


def server_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if certfile is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


class Holding:
    """A version this host serves: its manifest, a descriptor per file, and which chunks are
    verified (all of them for the learner's store). `mark` and `finish` may be called from any
    thread; `wait` runs in the server's loop."""

    def __init__(self, manifest: Manifest, fds: dict[str, int], complete: bool):
        self.manifest, self.fds = manifest, fds
        self._verified: dict[str, set[int]] = {n: set() for n in fds}
        self.complete, self.failed = complete, False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._changed = loop, asyncio.Event()

    def _notify(self) -> None:
        if self._loop is not None and self._changed is not None:
            self._loop.call_soon_threadsafe(self._changed.set)

    def mark(self, name: str, index: int) -> None:
        self._verified[name].add(index)
        self._notify()

    def finish(self, ok: bool) -> None:
        self.complete, self.failed = ok, not ok
        self._notify()

    def has(self, name: str, start: int, stop: int) -> bool:
        if self.complete:
            return True
        spec = self.manifest.files[name]
        first, last = start // spec.chunk_bytes, max(start, stop - 1) // spec.chunk_bytes
        return all(i in self._verified[name] for i in range(first, last + 1))

    async def wait(self, name: str, start: int, stop: int, timeout_s: float) -> bool:
        """Whether [start, stop) of `name` is verified, waiting up to `timeout_s` for it."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.has(name, start, stop):
            left = deadline - asyncio.get_running_loop().time()
            if self.failed or left <= 0 or self._changed is None:
                return False
            self._changed.clear()
            if self.has(name, start, stop):
                break
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return False
        return True

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class WeightServer:
    """`store`: serve that store's versions (the learner); without it, only what `hold` is
    given (a relay). `planner`: answer `/source` (the learner), for the generators
    `registrations` vouches for (with `fanout`)."""

    def __init__(
        self,
        token: str,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        store: WeightStore | None = None,
        fanout: int | None = None,
        registrations: Registrations | None = None,
        limits: ServerLimits | None = None,
    ):
        self._auth = f"Bearer {token}".encode()
        self.host, self.port, self._ssl = host, port, ssl_context
        self._store = store
        self._fanout, self._registrations = fanout, registrations
        self.limits = limits or ServerLimits()
        self.refusals = Throttle(log, "weights server")
        self.desk: SourceDesk | None = None  # the learner's: who fetches from where
        self.listener: GuardedListener | None = None  # its connections, once started
        self._holdings: dict[int, Holding] = {}
        self._expected: set[int] = set()
        self.served: Counter[int] = Counter()  # version -> bytes of file data sent
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # --- the owner's side (any thread) --------------------------------------------------------
    def start(self) -> str:
        """Bind and serve in a thread of its own; returns the URL others reach it at."""
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name="weight-server", daemon=True
        )
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.url

    def expect(self, version: int) -> None:
        """A fetch of `version` is starting here: hold requests for it until `hold`."""
        with self._lock:
            self._expected.add(version)

    def hold(self, manifest: Manifest, fds: dict[str, int], complete: bool = False) -> Holding:
        """Serve `manifest`'s version from `fds` (duplicated: the caller keeps its own)."""
        holding = Holding(manifest, {n: os.dup(fd) for n, fd in fds.items()}, complete)
        if self._loop is not None:
            holding.attach(self._loop)
        with self._lock:
            old = self._holdings.pop(manifest.version, None)
            self._holdings[manifest.version] = holding
            self._expected.discard(manifest.version)
        if old is not None:
            self._call(old.close)
        return holding

    def forget(self, versions: list[int]) -> None:
        """Stop serving these versions (deleted by retention, or a fetch that failed)."""
        with self._lock:
            gone = [self._holdings.pop(v) for v in versions if v in self._holdings]
            self._expected.difference_update(versions)
        for holding in gone:
            holding.finish(False)
            self._call(holding.close)

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for holding in self._holdings.values():
                holding.close()
            self._holdings = {}

    def _call(self, fn: Any) -> None:
        """Run `fn` in the server's loop (after requests already running there)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(fn)
        else:
            fn()

    # --- the server's thread ------------------------------------------------------------------
    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(middlewares=[self._check_token], client_max_size=MAX_BODY)
        app.router.add_get("/v/{version:\\d+}/{name}", self._file)
        app.router.add_post("/v/{version:\\d+}/source", self._source)
        app.router.add_get("/stats", self._stats)
        runner = web.AppRunner(app, **runner_options(self.limits, log, "weights server"))
        try:
            loop.run_until_complete(runner.setup())
            assert runner.server is not None
            listener = GuardedListener(runner.server, self.limits, "weights server", self._ssl)
            host, port = loop.run_until_complete(listener.start(self.host, self.port))
            self.listener = listener
        except BaseException as e:  # the port is taken, the certificate unreadable, ...
            failure.append(e)
            ready.set()
            return
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if self._ssl else 'http'}://{shown}:{port}"
        if self._fanout is not None and self._registrations is not None:
            planner = SourcePlanner(self.url, self._fanout)
            self.desk = SourceDesk(planner, self._registrations, self._refuse, self.limits)
        self._loop = loop
        with self._lock:
            for holding in self._holdings.values():
                holding.attach(loop)
        ready.set()
        try:
            loop.run_forever()
        finally:
            listener.close()
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def _refuse(self, request: web.Request, status: int, why: str) -> web.HTTPException:
        """The 4xx to raise for `request`, logged in one (throttled) line."""
        self.refusals.refused(request, why)
        return _ERRORS[status](text=f"{why}\n")

    def _version(self, request: web.Request) -> int:
        digits = request.match_info["version"]
        if len(digits) > MAX_VERSION_DIGITS:
            why = f"a version has at most {MAX_VERSION_DIGITS} digits"
            raise self._refuse(request, 400, why)
        return int(digits)

    @web.middleware
    async def _check_token(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._auth):
            raise web.HTTPUnauthorized(text="a valid weights token is required\n")
        return await handler(request)

    async def _holding(self, version: int) -> Holding | None:
        with self._lock:
            holding = self._holdings.get(version)
            expected = version in self._expected
        if holding is None and self._store is not None:
            holding = await asyncio.get_running_loop().run_in_executor(
                None, self._open_from_store, version
            )
        if holding is None and expected:  # a relay about to hold it: its fetch has begun
            deadline = asyncio.get_running_loop().time() + RELAY_WAIT_S
            while holding is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                with self._lock:
                    holding = self._holdings.get(version)
                    if version not in self._expected and holding is None:
                        break
        return holding

    def _open_from_store(self, version: int) -> Holding | None:
        assert self._store is not None
        try:
            opened = self._store.open_version(version)
        except CorruptWeights:
            return None
        try:
            return self.hold(opened.manifest, opened.fds, complete=True)
        finally:
            opened.close()

    async def _file(self, request: web.Request) -> web.StreamResponse:
        version, name = self._version(request), request.match_info["name"]
        holding = await self._holding(version)
        if holding is None or (name != "manifest.json" and name not in holding.fds):
            raise web.HTTPNotFound(text=f"weights v{version}: no {name} here\n")
        if name == "manifest.json":
            return web.Response(body=holding.manifest.raw, content_type="application/json")
        size = holding.manifest.files[name].size
        try:
            wanted = request.http_range
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable() from None
        start = wanted.start or 0
        start = max(0, size + start) if start < 0 else start
        stop = size if wanted.stop is None else min(size, wanted.stop)
        if not await holding.wait(name, start, stop, RELAY_WAIT_S):
            raise web.HTTPServiceUnavailable(text=f"weights v{version}: not verified here yet\n")
        self.served[version] += max(0, stop - start)
        return web.FileResponse(f"/proc/self/fd/{holding.fds[name]}")

    async def _source(self, request: web.Request) -> web.Response:
        version = self._version(request)
        if self.desk is None:
            raise web.HTTPNotFound(text="this server assigns no sources\n")
        if await self._holding(version) is None:
            raise web.HTTPNotFound(text=f"weights v{version}: not here\n")
        return await self.desk.answer(request, version)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"served": {str(v): n for v, n in self.served.items()}})


_ERRORS: dict[int, Callable[..., web.HTTPException]] = {
    400: web.HTTPBadRequest,
    403: web.HTTPForbidden,
    408: web.HTTPRequestTimeout,
    413: partial(web.HTTPRequestEntityTooLarge, MAX_BODY),
}
