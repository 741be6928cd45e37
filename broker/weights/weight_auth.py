"""Who may ask the learner's weight server for a source, and offer itself as a relay
(`weights.transport: http`, `POST /v/{version}/source`, broker/weights/weight_server.py).

The run's weights token lets its holder read versions; it does not say which generator asks. A
request for a source also makes the asker a holder that other generators are sent to, so it
must come from the generator it names, with that generator's own relay address. Each generator
proves this with its Redis credentials, which reach only its own keys (broker/connect/acl.py):
- at the start of every fetch it writes, in its own status hash `gen:{id}`, the sha256 of a
  random key it drew at start (`KEY_FIELD`) and the URL its relay serves on (`RELAY_FIELD`, empty
  when it does not relay), `credential_fields`;
- it sends the key itself only with its request for a source, to the learner's server (headers
  `GENERATOR_HEADER`, `KEY_HEADER`), never to a relay;
- the learner's server reads that hash (`registered`: the learner's user may read every
  generator's) and answers only a request whose key hashes to the one written there, from a
  generator that is not quarantined, offering no relay or exactly the registered one, which
  must be `http(s)://host:port` (`relay_url_problem`).
So a holder of the run's token who is not generator G cannot ask as G, nor point anyone at an
address G did not write with its own credentials. With Redis ACLs off (one password for all),
any process that can write Redis can write `gen:{id}`: confinement is the ACL's (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rollflash.broker.connect.keys import valid_name

if TYPE_CHECKING:  # the learner's side only: a generator (and the GPU check) imports no redis
    from rollflash.broker.connect.redis_io import RunRedis

KEY_FIELD = "weights_key_sha256"
RELAY_FIELD = "weights_relay"
GENERATOR_HEADER = "Rollflash-Generator"
KEY_HEADER = "Rollflash-Generator-Key"


def new_key() -> str:
    return secrets.token_urlsafe(32)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def credential_fields(key: str, relay_url: str | None) -> dict[str, str]:
    """What a generator writes in its status hash before it asks for a source."""
    return {KEY_FIELD: _digest(key), RELAY_FIELD: relay_url or ""}


@dataclass(frozen=True)
class Registration:
    """What generator `generator` wrote in its own status hash."""

    generator: str
    key_sha256: str
    relay: str | None  # None: it relays nothing
    status: str | None  # `active`, `quarantined <reason>`, or None before its admission

    def refusal(self, key: str, relay: str | None) -> str | None:
        """Why a request with `key` offering `relay` is not this generator's (None: it is)."""
        from rollflash.broker.channels.roster import ACTIVE

        if self.status not in (None, ACTIVE):
            return f"generator {self.generator} is {self.status}"
        if not hmac.compare_digest(_digest(key), self.key_sha256):
            return f"the key is not generator {self.generator}'s"
        if relay is not None and relay != self.relay:
            return f"generator {self.generator} registered no relay at {relay[:100]}"
        return None


def relay_url_problem(url: str) -> str | None:
    """Why `url` cannot be a relay's address (None: it can): `http(s)://host:port` only."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https"):
        return f"the scheme must be http or https, not {parts.scheme or 'none'!r}"
    if not parts.hostname or port is None or "@" in parts.netloc:
        return "expected http(s)://host:port"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "expected http(s)://host:port, without a path, query or fragment"
    return None


def registered(io: RunRedis, generator: str) -> Registration | None:
    """What `generator` wrote in its status hash, with its status; None if no key is there."""
    from rollflash.broker.connect.redis_io import opt_text

    if not valid_name(generator):
        return None
    pipe = io.client.pipeline(transaction=False)
    pipe.hmget(io.keys.gen(generator), [KEY_FIELD, RELAY_FIELD])
    pipe.hget(io.keys.generators, generator)
    (key_sha, relay), status = pipe.execute()
    if not key_sha:
        return None
    relay_text = opt_text(relay) or None
    if relay_text is not None and relay_url_problem(relay_text) is not None:
        relay_text = None  # written, but no address anyone should be sent to
    return Registration(generator, str(opt_text(key_sha)), relay_text, opt_text(status))
