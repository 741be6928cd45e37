"""The HTTP servers cannot be starved, and answer malformed requests with a 4xx and one log line
(rollflash/http_guard.py): the learner's weight server as its publishing process builds it
(`VersionWriter`, broker/weights/weight_server.py), a generator's relay as `HttpSource` builds it, and
the agent endpoint (envs/agent_server.py); each a real aiohttp server on loopback, attacked with
real sockets. Attackers connect from 127.0.0.2 and 127.0.0.3 (all of 127/8 is this host's
loopback), honest clients from 127.0.0.1. Time bounds are generous: what is asserted is that a
connection is closed before a bound, never how fast."""

from __future__ import annotations

import http.client
import json
import logging
import queue
import resource
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
import torch

from rollflash.envs.agent_server import AgentServer
from rollflash.http_guard import ServerLimits
from tests.helpers.certs import make_certs
from tests.helpers.weight_hosts import ROWS, TOKEN, fetch, host_cfg, learner, source

PARTIAL = b"GET /v/1/manifest.js"  # part of a request line, and nothing more
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def descriptors(n: int) -> Iterator[None]:
    """At least `n` descriptors for this process (the attack's sockets and, in this same process,
    the server's): the soft RLIMIT_NOFILE raised as far as the hard one allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def partial_connections(
    address: tuple[str, int], n: int, peer: str, data: bytes = PARTIAL
) -> list[socket.socket]:
    """`n` connections from `peer`, each sending `data` (part of a request line)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind((peer, 0))
        s.settimeout(30)
        s.connect(address)
        s.setblocking(False)  # a socket with a timeout waits in recv even with MSG_DONTWAIT
        try:
            if data:
                s.send(data)
        except OSError:  # reset already: over a cap
            pass
        out.append(s)
    return out


def closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (EOF or reset); reads what is waiting, never blocks."""
    try:
        while True:
            data = s.recv(65536, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def still_open(sockets: list[socket.socket]) -> list[socket.socket]:
    return [s for s in sockets if not closed(s)]


def wait_until(condition: Callable[[], bool], bound_s: float, what: str, tick=lambda: None):
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {bound_s:.0f}s: {what}"
        tick()
        time.sleep(0.2)


def trickle(sockets: list[socket.socket]) -> Callable[[], None]:
    """A byte more to each open socket now and then, as a slowloris client keeps itself alive."""
    last = [0.0]

    def tick() -> None:
        if time.monotonic() - last[0] < 1.0:
            return
        last[0] = time.monotonic()
        for s in sockets:
            try:
                s.send(b"x", socket.MSG_DONTWAIT)
            except OSError:
                pass

    return tick


def no_traceback(caplog) -> None:
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert "Traceback" not in caplog.text


def test_1100_partial_connections_cannot_starve_the_learners_weight_server(
    weights_token, tmp_path, learner_broker, brokers, caplog
):
    """1,100 connections from one address, each sending part of a request line and then a byte
    a second: the server keeps 256 (weights.max_connections_per_peer) and resets the other 844
    as it accepts them; a generator's authenticated fetch of a 48 MiB version completes
    meanwhile; every attacking connection is closed request_timeout_s after it opened, however
    it trickles. The refusals cost a few log lines, not 1,100."""
    caplog.set_level(logging.WARNING)
    # 30 s: the held connections are surely still open while the fetch runs
    with descriptors(4096):
        writer, announced = learner(tmp_path, learner_broker, "weights.request_timeout_s=30")
        gen = source(host_cfg(tmp_path, "g0", "weights.relay=false"), brokers, "g0")
        assert writer.server is not None and writer.server.listener is not None
        listener = writer.server.listener
        attack: list[socket.socket] = []
        try:
            for _ in range(11):
                attack += partial_connections(_address(writer.http_url), 100, "127.0.0.2")
                assert listener.per_peer["127.0.0.2"] <= 256
            wait_until(lambda: len(still_open(attack)) <= 256, 60, "844 connections reset")
            assert listener.per_peer["127.0.0.2"] == 256  # held, not yet timed out
            torch.testing.assert_close(
                fetch(gen, announced), torch.arange(ROWS * 1024.0).view(ROWS, 1024)
            )
            wait_until(
                lambda: not still_open(attack), 30 + 90, "every partial connection closed",
                trickle(attack),
            )  # fmt: skip
            wait_until(lambda: listener.total == 0, 60, "no connection left open")
        finally:
            for s in attack:
                s.close()
            gen.close()
            writer.close()
    no_traceback(caplog)
    # reasons "refused connections" and "closed connections that sent no complete request
    # headers": at most 10 lines each per 10 s (http_guard.BURST), over a test of at most ~4 min
    assert len(caplog.records) <= 2 * 10 * 24


def test_the_connection_caps_bind_per_peer_and_in_all(weights_token, tmp_path, learner_broker):
    """weights.max_connections_per_peer 5 and max_connections 8: 7 connections from one address
    leave 5 open, 7 from another 3 more (8 in all); a request from a third address is reset
    while all 8 are held, and answered once the first attacker lets go."""
    writer, _ = learner(
        tmp_path,
        learner_broker,
        "weights.max_connections_per_peer=5",
        "weights.max_connections=8",
        "weights.request_timeout_s=120",
    )
    address = _address(writer.http_url)
    first = partial_connections(address, 7, "127.0.0.2")
    second: list[socket.socket] = []
    try:
        wait_until(lambda: len(still_open(first)) == 5, 60, "2 of 7 reset (5 per peer)")
        second = partial_connections(address, 7, "127.0.0.3")
        wait_until(lambda: len(still_open(second)) == 3, 60, "4 of 7 reset (8 in all)")
        assert len(still_open(first)) == 5
        honest = partial_connections(address, 1, "127.0.0.1")
        wait_until(lambda: not still_open(honest), 60, "a ninth connection reset")
        for s in first:
            s.close()
        assert writer.server is not None and writer.server.listener is not None
        listener = writer.server.listener
        wait_until(lambda: listener.total == 3, 60, "the first attacker's 5 released")
        assert _request(writer.http_url, "GET", "/v/1/manifest.json", AUTH)[0] == 200
    finally:
        for s in first + second:
            s.close()
        writer.close()


def test_request_timeout_s_closes_what_sends_no_complete_headers(weights_token, tmp_path, brokers):
    """Two generators' relays (as HttpSource builds them) with weights.request_timeout_s 2 and
    120: a connection that sends part of a request line is closed by the first, while the
    second still holds its own."""
    quick = source(host_cfg(tmp_path, "q", "weights.request_timeout_s=2"), brokers, "g0")
    patient = source(host_cfg(tmp_path, "p", "weights.request_timeout_s=120"), brokers, "g1")
    assert quick.server is not None and patient.server is not None
    try:
        (to_quick,) = partial_connections(_address(quick.server.url), 1, "127.0.0.2")
        (to_patient,) = partial_connections(_address(patient.server.url), 1, "127.0.0.2")
        wait_until(lambda: closed(to_quick), 60, "the 2 s server closed its connection")
        assert not closed(to_patient)
    finally:
        quick.close()
        patient.close()


def test_a_tls_handshake_counts_and_is_timed_from_its_accept(weights_token, tmp_path, brokers):
    """A relay serving TLS (weights.ssl_*), one connection per address, 2 s: a connection that
    never starts its handshake holds the address's one place (a second is reset at once, so
    handshakes are counted before they end) and is closed after 2 s; then a real TLS request
    from that address is answered."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    relay = source(
        host_cfg(
            tmp_path,
            "tls",
            f"weights.ssl_certfile={certs / 'server.pem'}",
            f"weights.ssl_keyfile={certs / 'server.key'}",
            "weights.max_connections_per_peer=1",
            "weights.request_timeout_s=2",
        ),
        brokers,
        "g0",
    )
    assert relay.server is not None and relay.server.url.startswith("https://")
    try:
        address = _address(relay.server.url)
        silent = partial_connections(address, 1, "127.0.0.1", b"")  # no ClientHello ever
        second = partial_connections(address, 1, "127.0.0.1", b"")
        wait_until(lambda: still_open(silent + second) == silent, 60, "the second one reset")
        wait_until(lambda: not still_open(silent), 60, "the silent one closed after 2 s")
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        host, port = address
        conn = http.client.HTTPSConnection(host, port, timeout=60, context=context)
        conn.request("GET", "/v/1/manifest.json", headers=AUTH)
        assert conn.getresponse().status == 404  # answered: the relay holds no v1
        conn.close()
    finally:
        relay.close()


def _request(url: str, method: str, path: str, headers: dict, body: bytes | None = None):
    """(status, body) of one request over a fresh connection."""
    host, port = _address(url)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _raw(url: str, data: bytes, bound_s: float = 60) -> bytes:
    """What the server answers `data` with, until it closes the connection."""
    s = socket.create_connection(_address(url), timeout=bound_s)
    try:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    except ConnectionResetError:
        return out
    finally:
        s.close()


def request_lines(caplog) -> list[str]:
    """The lines the servers logged about requests (not the connection-level refusals and
    timeouts an earlier attack still reports, nor lines of other threads in this process)."""
    return [m for r in caplog.records if "refused a" in (m := r.getMessage()) and "request" in m]


def one_line_each(caplog, calls: list[tuple[int, Callable[[], int]]]) -> None:
    """Each call answers its status and adds exactly one log line about it, with no traceback."""
    for status, call in calls:
        before = len(request_lines(caplog))
        assert call() == status
        wait_until(
            lambda b=before: len(request_lines(caplog)) > b, 30, f"a log line for a {status}"
        )
        assert len(request_lines(caplog)) == before + 1, caplog.text
    no_traceback(caplog)


def test_malformed_requests_to_the_weight_server_get_4xx_and_one_line(
    weights_token, tmp_path, learner_broker, brokers, caplog
):
    """A 5,000-digit version, a body nested 30,000 deep, bytes that are not UTF-8, a body that
    never arrives, one over 64 KiB and a header line without a colon: each gets its 4xx and one
    log line, never a 500 or a traceback. The token is checked before a body is read: 401 to a
    request that announces a body and sends none."""
    caplog.set_level(logging.WARNING)
    writer, announced = learner(tmp_path, learner_broker, "weights.request_timeout_s=3")
    gen = source(host_cfg(tmp_path, "g0", "weights.relay=false"), brokers, "g0")
    try:
        fetch(gen, announced)  # registers g0's key, as before every fetch
        url, big = writer.http_url, "9" * 5000
        me = {**AUTH, **gen.client.identity}

        def post(body: bytes) -> int:
            return _request(url, "POST", "/v/1/source", me, body)[0]

        def status(raw: bytes) -> int:
            return int(raw.split(b" ", 2)[1])

        unsent = b"POST /v/1/source HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        headers = "".join(f"{k}: {v}\r\n" for k, v in me.items()).encode()
        one_line_each(
            caplog,
            [
                (400, lambda: _request(url, "GET", f"/v/{big}/manifest.json", AUTH)[0]),
                (400, lambda: _request(url, "POST", f"/v/{big}/source", me, b"{}")[0]),
                (400, lambda: post(b"[" * 30_000 + b"]" * 30_000)),
                (400, lambda: post(b'{"relay": "\xff\xfe"}')),
                (400, lambda: post(b'{"relay": 5, "failed": "x"}')),
                (408, lambda: status(_raw(url, unsent + headers + b"\r\n{"))),
                (413, lambda: post(b" " * (65 << 10))),
                (400, lambda: status(_raw(url, b"GET / HTTP/1.1\r\nno colon here\r\n\r\n"))),
            ],
        )
        before = len(caplog.records)
        assert status(_raw(url, unsent + b"\r\n", bound_s=30)) == 401  # no body awaited
        assert len(caplog.records) == before  # anyone can knock: not logged
    finally:
        gen.close()
        writer.close()


class _Responder:
    """What the agent host's loop does with each call (envs/agent_host.py), reduced to an echo:
    the endpoint under test is the server, not the engine."""

    def __init__(self, server: AgentServer):
        self.server, self.inbox = server, server.inbox
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (event := self.inbox.get()) is not None:
            _, pending = event
            self.server.reply(pending, 200, {"echo": pending.body})


def test_the_agent_endpoint_cannot_be_starved_and_refuses_bad_bodies_in_one_line(caplog):
    """The endpoint with at most 40 connections and a 3 s request timeout (all its callers are on
    this host: one address): 30 partial connections leave room for a real call, 20 more find 10
    places; each is closed after 3 s however it trickles. A body nested 50,000 deep, one that is
    not UTF-8 and one that never arrives get 400, 400 and 408 in the API's error form, one log
    line each; a call for an episode that is not open gets 404 before its body is read."""
    caplog.set_level(logging.WARNING)
    limits = ServerLimits(request_timeout_s=3, max_connections=40, max_connections_per_peer=40)
    server = AgentServer(queue.Queue(), limits=limits)
    responder = _Responder(server)
    server.open("ep")
    url, path = f"http://127.0.0.1:{server.port}", "/episodes/ep/v1/chat/completions"
    attack: list[socket.socket] = []
    try:
        attack = partial_connections(("127.0.0.1", server.port), 30, "127.0.0.1")
        status, body = _request(url, "POST", path, {}, b'{"model": "m"}')
        assert (status, json.loads(body)) == (200, {"echo": {"model": "m"}})
        attack += partial_connections(("127.0.0.1", server.port), 20, "127.0.0.1")
        wait_until(lambda: len(still_open(attack)) <= 40, 60, "10 over the cap reset")
        wait_until(lambda: not still_open(attack), 90, "every one closed", trickle(attack))

        def post(body: bytes) -> int:
            return _request(url, "POST", path, {}, body)[0]

        unsent = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode()
        one_line_each(
            caplog,
            [
                (400, lambda: post(b"[" * 30_000 + b"]" * 30_000)),
                (400, lambda: post(b'{"model": "\xff"}')),
                (408, lambda: int(_raw(url, unsent).split(b" ", 2)[1])),
            ],
        )
        closed_episode = unsent.replace(b"/ep/", b"/gone/")
        assert int(_raw(url, closed_episode, bound_s=30).split(b" ", 2)[1]) == 404
    finally:
        for s in attack:
            s.close()
        server.inbox.put(None)
        responder.thread.join(10)
        server.stop()
