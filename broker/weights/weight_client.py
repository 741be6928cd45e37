"""Fetching a weight version over HTTP (`weights.transport: http`), with aiohttp.

A generator asks the learner's server which holder to fetch a version from (broker/weights/weight_plan.py:
a relay that asked earlier, or the learner itself), reads the manifest there and checks it
against the digest the learner announced in Redis (broker/weights/manifest.py), then fetches every chunk
with `FETCH_STREAMS` range requests in flight, each into one of as many reused buffers, and hands
it to a `ChunkCheck` (broker/weights/weight_stream.py): a chunk is used only once its sha256 matches the
manifest. So a relay, or anything between the hosts, cannot change what is loaded, and a host
never loads a version the learner did not announce.

A relay that fails (refuses, times out, goes away, or sends bytes that do not match) is named to
the learner, which names another source: an earlier relay, or itself; the chunks already
verified are kept. A failure of the learner's own server fails the fetch (the generator tries
the version again later, generators/reload.py).

The request for a source carries this generator's id and key (broker/weights/weight_auth.py), which the
learner's server checks against what the generator registered in Redis; the key goes to the
learner's URL only, never to a relay, and a source that is not `http(s)://host:port` is refused
before anything is sent to it. Idle connections are closed after `KEEPALIVE_S`, well inside any
server's `weights.request_timeout_s`, so a request is never sent on one the server is closing.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from rollflash.broker.weights.manifest import CorruptWeights, Manifest, parse_manifest
from rollflash.broker.weights.weight_auth import GENERATOR_HEADER, KEY_HEADER, relay_url_problem
from rollflash.broker.weights.weight_stream import ChunkBuffers, ChunkCheck, Sink, chunk_order

log = logging.getLogger(__name__)

FETCH_STREAMS = 4  # range requests in flight per fetch (each fills one chunk buffer)
READ_TIMEOUT_S = 90.0  # above a relay's wait for chunks it has not verified yet
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_S = 1.0  # an idle connection is closed after this (servers allow at least 2 s)
PIECE = 4 << 20  # bytes read from a response at a time: fewer turns of the event loop per chunk


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """The TLS trust of a client: `ca_file`, else the system's CAs."""
    return ssl.create_default_context(cafile=ca_file)


class SourceFailed(RuntimeError):
    """A source answered with an error status (its body says why)."""


@dataclass
class Fetched:
    manifest: Manifest
    received: Counter[str] = field(default_factory=Counter)  # source URL -> bytes of file data
    failed: list[str] = field(default_factory=list)  # sources given up on


class WeightClient:
    """`key`: this generator's, registered in its status hash before each fetch (`credential`,
    broker/weights/weight_auth.py)."""

    def __init__(
        self, token: str, generator_id: str, key: str, ssl_context: ssl.SSLContext | None = None
    ):
        self._headers = {"Authorization": f"Bearer {token}"}
        self.identity = {GENERATOR_HEADER: generator_id, KEY_HEADER: key}
        self.generator_id, self._ssl = generator_id, ssl_context

    def fetch(
        self,
        learner_url: str,
        version: int,
        expect_sha256: str | None,
        make_sinks: Callable[[Manifest], list[Sink]],
        relay_url: str | None = None,
        on_chunk: Callable[[Manifest], Callable[[str, int], None] | None] | None = None,
        form: str | None = None,
    ) -> Fetched:
        """Fetch and verify `version` (its files of `form`, broker/weights/manifest.py; None: the
        version's kind) into the sinks `make_sinks(manifest)` returns; `relay_url`: where this
        host serves it on (it becomes a holder of that form); `on_chunk(manifest)` gives the
        hook that hears of every verified chunk."""
        fetch = _Fetch(self, learner_url, version, relay_url, form)
        return asyncio.run(fetch.run(expect_sha256, make_sinks, on_chunk))

    def manifest(
        self, learner_url: str, version: int, expect_sha256: str | None
    ) -> Manifest | None:
        """`version`'s manifest from the learner's server, checked against `expect_sha256`;
        None if the learner no longer has it."""

        async def get() -> bytes | None:
            async with self.session() as http:
                async with http.get(f"{learner_url}/v/{version}/manifest.json") as r:
                    if r.status == 404:
                        return None
                    await _ok(r)
                    return await r.read()

        raw = asyncio.run(get())
        return None if raw is None else parse_manifest(raw, version, expect_sha256)

    def session(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        connector = aiohttp.TCPConnector(
            limit=2 * FETCH_STREAMS, ssl=self._ssl or True, keepalive_timeout=KEEPALIVE_S
        )
        return aiohttp.ClientSession(
            headers=self._headers, timeout=timeout, connector=connector, read_bufsize=PIECE
        )


# what a relay's failure can raise: a reset peer can surface as a bare ConnectionResetError
# rather than aiohttp's wrapper of it (other OSErrors, a full disk, are this host's own)
_NETWORK = (
    aiohttp.ClientError,
    ConnectionError,
    asyncio.TimeoutError,
    SourceFailed,
    CorruptWeights,
)


class _Fetch:
    """One fetch: the source in use and the switches away from failed ones."""

    def __init__(
        self,
        client: WeightClient,
        learner_url: str,
        version: int,
        relay: str | None,
        form: str | None,
    ):
        self.client, self.learner, self.version, self.relay = client, learner_url, version, relay
        self.form = form  # None: the version's kind, whatever the manifest says it is
        self.source = learner_url
        self.result: Fetched | None = None
        self._failed: list[str] = []
        self._switching = asyncio.Lock()

    async def run(self, expect_sha256, make_sinks, on_chunk) -> Fetched:
        async with self.client.session() as self.http:
            await self._ask()
            raw = await self._with_failover(self._manifest)
            manifest = parse_manifest(raw, self.version, expect_sha256)
            self.result = Fetched(manifest)
            files = manifest.form_files(self.form or manifest.kind)
            check = ChunkCheck(manifest, make_sinks(manifest), files=files)  # opens the sinks
            if on_chunk is not None:
                check.on_chunk = on_chunk(manifest)
            try:
                await self._chunks(manifest, check)
            finally:
                check.close()
            self.result.failed = list(self._failed)
            return self.result

    async def _chunks(self, manifest: Manifest, check: ChunkCheck) -> None:
        specs = [manifest.files[n] for n in check.files]
        largest = max((min(f.chunk_bytes, f.size) for f in specs), default=0)
        buffers = ChunkBuffers(max(1, largest), FETCH_STREAMS)
        todo = chunk_order(manifest, check.files)
        with ThreadPoolExecutor(FETCH_STREAMS, "verify") as pool:

            async def one(name: str, index: int) -> None:
                start, end = manifest.files[name].span(index)
                with buffers.take() as buf:

                    async def attempt(source: str) -> None:
                        got = await self._range(source, name, start, end, buf)
                        loop = asyncio.get_running_loop()
                        await loop.run_in_executor(pool, check.accept, name, index, buf[:got])
                        assert self.result is not None
                        self.result.received[source] += got

                    await self._with_failover(attempt)

            while todo and not check.ready(todo[0][0]):
                await one(*todo.pop(0))

            async def worker() -> None:
                while todo:
                    await one(*todo.pop(0))

            tasks = [asyncio.create_task(worker()) for _ in range(FETCH_STREAMS)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

    async def _with_failover(self, call):
        """`call(source)`; when a relay fails, name it to the learner and try the next source."""
        while True:
            source = self.source
            try:
                return await call(source)
            except _NETWORK as e:
                if source == self.learner:
                    raise
                await self._switch(source, e)

    async def _switch(self, source: str, error: BaseException) -> None:
        async with self._switching:
            if source in self._failed:  # another request saw it fail first
                return
            self._failed.append(source)
            log.warning(
                "weights v%d: relay %s failed (%s: %s); asking the learner for another source",
                self.version,
                source,
                type(error).__name__,
                str(error)[:200],
            )
            await self._ask()

    async def _ask(self) -> None:
        body = {"relay": self.relay, "failed": self._failed, "form": self.form or "full"}
        url, identity = f"{self.learner}/v/{self.version}/source", self.client.identity
        async with self.http.post(url, json=body, headers=identity) as r:
            await _ok(r)
            source = (await r.json()).get("url")
        problem = relay_url_problem(source) if isinstance(source, str) else "not a string"
        if problem is not None:
            raise SourceFailed(f"the learner named a source that is not http(s) ({problem})")
        self.source = str(source)
        if self.source != self.learner:
            log.info("weights v%d: fetching from relay %s", self.version, self.source)

    async def _manifest(self, source: str) -> bytes:
        async with self.http.get(f"{source}/v/{self.version}/manifest.json") as r:
            await _ok(r)
            return await r.read()

    async def _range(self, source: str, name: str, start: int, end: int, buf: memoryview) -> int:
        """Bytes [start, end) of `name` from `source` into `buf`; returns how many came."""
        headers = {"Range": f"bytes={start}-{end - 1}"}
        async with self.http.get(f"{source}/v/{self.version}/{name}", headers=headers) as r:
            await _ok(r)
            got = 0
            async for piece in r.content.iter_chunked(PIECE):
                if got + len(piece) > end - start:
                    raise SourceFailed(f"{source} sent more than the {end - start} bytes asked")
                buf[got : got + len(piece)] = piece
                got += len(piece)
            return got


async def _ok(r: aiohttp.ClientResponse) -> None:
    if r.status >= 300:
        text = (await r.text())[:200].strip()
        raise SourceFailed(f"{r.url.host}:{r.url.port} answered {r.status} {text}")
