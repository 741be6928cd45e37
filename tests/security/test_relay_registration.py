"""Relays by invitation only (broker/weights/weight_auth.py, broker/weights/weight_sources.py): the learner's
weight server, as its publishing process builds it, names a source only to the generator that
asks, proven by the key it registered with its own Redis credentials, and sends generators only
to relays those generators registered. Real redis-server, real servers on loopback; the attacker
holds the run's weights token (and, for some attacks, a generator's own credentials)."""

from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import urlsplit

from rollflash.broker.weights.weight_auth import GENERATOR_HEADER, KEY_HEADER
from tests.helpers.brokers import admit
from tests.helpers.weight_hosts import TOKEN, fetch, host_cfg, learner, source

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def ask(url: str, headers: dict, body: dict, conn: http.client.HTTPConnection | None = None):
    """(status, reply) of a request for v1's source; over `conn` if given (kept alive)."""
    parts = urlsplit(url)
    own = conn is None
    conn = conn or http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", "/v/1/source", json.dumps(body), {**AUTH, **headers})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        if own:
            conn.close()


def test_only_the_generator_named_with_its_own_key_and_address_is_given_a_source(
    weights_token, tmp_path, learner_broker, brokers, caplog
):
    """g0 and g1 are generators of the run, each with its own key registered in its own status
    hash; the attacker has the run's token, and g1's key (a compromised generator):
    - without a generator's key, or naming g0 with g1's key: 403;
    - as g1, offering `file:///etc/passwd` or an address of its own as relay: 400, 403;
    - as a quarantined generator, with its right key: 403;
    and none of it lands in the plan: g0 then fetches v1 from the learner, g1 from g0's relay."""
    caplog.set_level(logging.WARNING)
    writer, announced = learner(tmp_path, learner_broker)
    g0 = source(host_cfg(tmp_path, "g0"), brokers, "g0")
    g1 = source(host_cfg(tmp_path, "g1"), brokers, "g1")
    g2 = source(host_cfg(tmp_path, "g2", "weights.relay=false"), brokers, "g2")
    try:
        for gen in (g0, g1, g2):
            gen.register()  # what it does before every fetch
        admit(learner_broker, g2._broker)
        assert learner_broker.roster.quarantine("g2", "a test")
        url = writer.http_url
        stolen = g1.client.identity[KEY_HEADER]
        assert g0.server is not None and g1.server is not None
        refusals = [
            (403, {}, {"relay": g0.server.url}),  # the token alone
            (403, {GENERATOR_HEADER: "g0", KEY_HEADER: stolen}, {"relay": g0.server.url}),
            (403, {GENERATOR_HEADER: "g0", KEY_HEADER: stolen}, {"relay": None}),
            (400, g1.client.identity, {"relay": "file:///etc/passwd"}),
            (403, g1.client.identity, {"relay": "http://127.0.0.9:8080"}),
            (403, g1.client.identity, {"relay": g0.server.url}),  # another's address
            (403, {GENERATOR_HEADER: "nobody", KEY_HEADER: stolen}, {"relay": None}),
            (403, g2.client.identity, {"relay": None}),  # quarantined
        ]
        for status, headers, body in refusals:
            assert ask(url, headers, body)[0] == status, (headers.keys(), body)
        assert writer.server is not None and writer.server.desk is not None
        assert writer.server.desk.planner.holders() == 0  # nothing was planned
        assert "generator g2 is quarantined a test" in caplog.text
        fetch(g0, announced)
        fetch(g1, announced)
        size = writer.store.manifest(1).files["model.safetensors"].size
        assert [g0.server.served[1], g1.server.served[1]] == [size, 0]
    finally:
        for gen in (g0, g1, g2):
            gen.close()
        writer.close()


def test_forged_registrations_leave_the_plan_as_it_was(
    weights_token, tmp_path, learner_broker, brokers
):
    """1,000 requests for a source under 1,000 names with the run's token, and 1,000 more as a
    real generator naming relays it never registered: all refused, and the plan holds nothing
    (its own bound, for registrations that pass, is tests/unit/test_weight_plan.py)."""
    writer, _ = learner(tmp_path, learner_broker)
    g0 = source(host_cfg(tmp_path, "g0", "weights.relay=false"), brokers, "g0")
    parts = urlsplit(writer.http_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        g0.register()
        forged_key = {KEY_HEADER: "k" * 43}
        for i in range(1000):
            assert (
                ask(writer.http_url, {GENERATOR_HEADER: f"x{i}", **forged_key}, {}, conn)[0] == 403
            )
            relay = {"relay": f"http://10.1.{i // 250}.{i % 250}:80"}
            assert ask(writer.http_url, g0.client.identity, relay, conn)[0] == 403
        assert writer.server is not None and writer.server.desk is not None
        assert writer.server.desk.planner.holders() == 0
    finally:
        conn.close()
        g0.close()
        writer.close()
