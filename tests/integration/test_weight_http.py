"""`weights.transport: http` on one host (real redis-server, real HTTP on loopback; the multi-host
run is tests/multihost): the learner's `VersionWriter` serves its store and announces its URL,
generators (`HttpSource`, the sim engine) fetch a version into stores of their own and relay it,
so the learner sends one copy however many fetch it; every chunk is checked against the announced
manifest, so a relay that serves other bytes, or goes away, is replaced by the learner; nothing
is served without the token; TLS with the project's certificates (weights.ssl_*, or the CA that
redis.url names)."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
import torch

from rollflash.broker.weights.digest import CHUNK_BYTES
from rollflash.broker.weights.manifest import MODEL_FILE
from rollflash.learner.durability.publish_process import VersionWriter
from tests.helpers.certs import make_certs
from tests.helpers.weight_hosts import ROWS, TOKEN, fetch, host_cfg, learner, source

_cfg, _source, _learner, _fetch = host_cfg, source, learner, fetch


def _served(writer: VersionWriter) -> int:
    assert writer.server is not None
    return writer.server.served[1]


@contextmanager
def _hosts(tmp_path, learner_broker, brokers, n: int, *extra: str):
    """The learner's writer with v1 announced, and `n` generators' sources; all closed after."""
    writer, announced = _learner(tmp_path, learner_broker)
    sources = [_source(_cfg(tmp_path, f"g{i}", *extra), brokers, f"g{i}") for i in range(n)]
    try:
        yield writer, announced, sources
    finally:
        for s in sources:
            s.close()
        writer.close()


def _size(writer: VersionWriter) -> int:
    return writer.store.manifest(1).files[MODEL_FILE].size


def test_two_generators_fetch_a_version_and_the_learner_sends_it_once(
    weights_token, tmp_path, learner_broker, brokers
):
    got: dict[int, torch.Tensor] = {}
    with _hosts(tmp_path, learner_broker, brokers, 2) as (writer, announced, sources):
        threads = [
            threading.Thread(target=lambda i=i: got.update({i: _fetch(sources[i], announced)}))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        expected = torch.arange(ROWS * 1024.0).view(ROWS, 1024)
        for i in range(2):
            torch.testing.assert_close(got[i], expected, atol=0, rtol=0)
            kept = sources[i].store.version_dir(1) / MODEL_FILE  # its own store, for relaying
            assert kept.read_bytes() == (writer.store.version_dir(1) / MODEL_FILE).read_bytes()
        # whichever asked second was sent to the first one's relay: one copy left the learner
        assert _served(writer) == _size(writer)
        assert sum(s.server.served[1] for s in sources) == _size(writer)


def test_with_relay_off_every_generator_fetches_from_the_learner(
    weights_token, tmp_path, learner_broker, brokers
):
    with _hosts(tmp_path, learner_broker, brokers, 2, "weights.relay=false") as (
        writer,
        announced,
        gens,
    ):
        for s in gens:
            assert s.server is None
            _fetch(s, announced)
        assert _served(writer) == 2 * _size(writer)


def test_a_relay_that_is_gone_is_replaced_by_the_learner(
    weights_token, tmp_path, learner_broker, brokers
):
    with _hosts(tmp_path, learner_broker, brokers, 2) as (writer, announced, (first, second)):
        _fetch(first, announced)
        first.server.close()  # the relay's host went away
        torch.testing.assert_close(
            _fetch(second, announced)[-1], torch.arange(1024.0) + (ROWS - 1) * 1024
        )
        assert _served(writer) == 2 * _size(writer)  # the second copy came from the learner


def test_a_relay_whose_connection_resets_is_replaced_by_the_learner(
    weights_token, tmp_path, learner_broker, brokers, monkeypatch
):
    """A peer killed mid-response can surface as a bare ConnectionResetError, not only as
    aiohttp's wrapper of it: either is the relay's failure, not the fetch's."""
    from rollflash.broker.weights import weight_client

    real_range = weight_client._Fetch._range

    async def resetting(self, source, name, start, end, buf):
        if source != self.learner:
            raise ConnectionResetError(104, "Connection reset by peer")
        return await real_range(self, source, name, start, end, buf)

    monkeypatch.setattr(weight_client._Fetch, "_range", resetting)
    with _hosts(tmp_path, learner_broker, brokers, 2) as (writer, announced, (first, second)):
        _fetch(first, announced)
        w = _fetch(second, announced)
        torch.testing.assert_close(w, torch.arange(ROWS * 1024.0).view(ROWS, 1024), atol=0, rtol=0)
        assert _served(writer) == 2 * _size(writer)  # the second copy came from the learner


def test_a_relay_serving_other_bytes_is_caught_and_replaced(
    weights_token, tmp_path, learner_broker, brokers
):
    with _hosts(tmp_path, learner_broker, brokers, 2) as (writer, announced, (first, second)):
        _fetch(first, announced)
        kept = first.store.version_dir(1) / MODEL_FILE
        raw = bytearray(kept.read_bytes())
        raw[CHUNK_BYTES + 5] ^= 0xFF  # the relay's copy changed after it verified it
        kept.write_bytes(raw)  # the same inode: what the relay serves
        w = _fetch(second, announced)
        torch.testing.assert_close(w, torch.arange(ROWS * 1024.0).view(ROWS, 1024), atol=0, rtol=0)
        # chunk 0 came from the relay, chunk 1 was refused there and fetched from the learner
        assert _served(writer) == _size(writer) + (_size(writer) - CHUNK_BYTES)


def _get(url: str, token: str | None, context=None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=context):
            return 200
    except urllib.error.HTTPError as e:
        return e.code


def test_nothing_is_served_without_the_token(weights_token, tmp_path, learner_broker, brokers):
    writer, announced = _learner(tmp_path, learner_broker)
    try:
        manifest = f"{writer.http_url}/v/1/manifest.json"
        assert _get(manifest, None) == 401
        assert _get(manifest, "not-the-token") == 401
        assert _get(f"{writer.http_url}/stats", TOKEN[:-1]) == 401
        assert _get(manifest, TOKEN) == 200
        assert _get(f"{writer.http_url}/v/1/..%2Fmanifest.json", TOKEN) == 404
        assert _get(f"{writer.http_url}/v/2/manifest.json", TOKEN) == 404  # not published
    finally:
        writer.close()


def test_tls_with_the_weights_certificates_or_the_ca_of_redis_url(
    weights_token, tmp_path, learner_broker, brokers
):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    serve = [
        f"weights.ssl_certfile={certs / 'server.pem'}",
        f"weights.ssl_keyfile={certs / 'server.key'}",
    ]
    writer, announced = _learner(tmp_path, learner_broker, *serve)
    assert writer.http_url.startswith("https://127.0.0.1:")
    trusting = [
        _cfg(tmp_path, "a", "weights.relay=false", f"weights.ssl_ca_certs={certs / 'ca.pem'}"),
        _cfg(
            tmp_path,
            "b",
            "weights.relay=false",
            f"redis.url=rediss://h:1/0?ssl_ca_certs={certs / 'ca.pem'}",
        ),
    ]
    try:
        for i, cfg in enumerate(trusting):
            source = _source(cfg, brokers, f"g{i}")
            _fetch(source, announced)
            source.close()
        untrusting = _source(_cfg(tmp_path, "c", "weights.relay=false"), brokers, "g2")
        with pytest.raises(Exception, match="(?i)certificate"):
            _fetch(untrusting, announced)
        untrusting.close()
        assert _served(writer) == 2 * _size(writer)
        stats = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{writer.http_url}/stats", headers={"Authorization": f"Bearer {TOKEN}"}
                ),
                context=__import__("ssl").create_default_context(cafile=str(certs / "ca.pem")),
            ).read()
        )
        assert stats["served"]["1"] == 2 * _size(writer)
    finally:
        writer.close()


@pytest.mark.parametrize("fanout, served", [(1, [1, 1, 0]), (2, [2, 0, 0])])
def test_fanout_shapes_the_tree_and_local_dir_holds_each_generators_store(
    weights_token, tmp_path, learner_broker, brokers, fanout, served
):
    """Three generators fetch one after another: with fanout 1 they form a chain (g1 from g0,
    g2 from g1), with 2 a star under g0; the learner sends one copy either way. Each keeps its
    store under weights.local_dir."""
    writer, announced = _learner(tmp_path, learner_broker, f"weights.fanout={fanout}")
    local = tmp_path / "elsewhere"
    sources = [
        _source(_cfg(tmp_path, f"g{i}", f"weights.local_dir={local}"), brokers, f"g{i}")
        for i in range(3)
    ]
    try:
        for s in sources:
            _fetch(s, announced)
        assert _served(writer) == _size(writer)
        assert [s.server.served[1] // _size(writer) for s in sources] == served
        assert all(s.store.root == local / f"g{i}" / "weights" for i, s in enumerate(sources))
    finally:
        for s in sources:
            s.close()
        writer.close()


def test_the_token_comes_from_token_file_else_the_environment(
    tmp_path, learner_broker, brokers, monkeypatch
):
    from rollflash.broker.config.config import ConfigError

    monkeypatch.delenv("ROLLFLASH_WEIGHTS_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="weights.token_file: .*ROLLFLASH_WEIGHTS_TOKEN"):
        _source(_cfg(tmp_path, "none"), brokers, "g0")
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    writer, announced = _learner(tmp_path, learner_broker, f"weights.token_file={token_file}")
    source = _source(_cfg(tmp_path, "g", f"weights.token_file={token_file}"), brokers, "g0")
    try:
        _fetch(source, announced)
        monkeypatch.setenv("ROLLFLASH_WEIGHTS_TOKEN", "another")  # a generator with another token
        wrong = _source(_cfg(tmp_path, "w", "weights.relay=false"), brokers, "g1")
        with pytest.raises(Exception, match="401"):
            _fetch(wrong, announced)
        wrong.close()
    finally:
        source.close()
        writer.close()
