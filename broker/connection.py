"""Connecting to Redis, and staying connected through restarts.

`connect(url, timeout_s)` returns a client whose every command rides out a lost connection: it
reconnects with exponential backoff (0.2 s doubling to 5 s) for up to `timeout_s`, then raises
`BrokerUnavailable` naming the (password-masked) URL.
So a Redis restart shorter than `redis.connect_timeout_s` is invisible to callers apart from the
wait: the learner, the generators and `rollctl status` all get this from `connect`.

A command retried after a lost connection may have run once already (the reply was lost): that is
why trajectories are at-least-once and the learner drops duplicates by `traj_id` (broker/streams.py).

Errors that retrying cannot fix fail at once with one line naming the cause: a wrong user or
password, a missing permission, a TLS certificate the client does not trust. The URL in every
message has its password masked.

URLs: `redis://[user:password@]host:port[/db]`, `rediss://...` for TLS (add
`?ssl_ca_certs=/path/ca.pem` for a private CA, `&ssl_certfile=...&ssl_keyfile=...` for client
certificates), `unix://[user:password@]/path/redis.sock`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rollflash.broker.secrets import redact

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.1  # first wait 0.2 s (base * 2), doubling
BACKOFF_CAP_S = 5.0


class BrokerUnavailable(RuntimeError):
    """Redis could not be reached (or refused writes) within the allowed time."""


def _fatal(e: BaseException) -> bool:
    """Connection errors that another attempt cannot fix (credentials, TLS trust)."""
    if isinstance(e, redis.AuthenticationError):
        return True
    text = str(e)
    return "CERTIFICATE_VERIFY_FAILED" in text or "WRONGPASS" in text or "NOAUTH" in text


class DeadlineRetry(Retry):
    """redis-py retry policy: back off and reconnect until `timeout_s` after the first failure
    (redis-py's own Retry counts attempts, which says nothing about how long Redis may be down)."""

    def __init__(self, timeout_s: float, shown_url: str):
        super().__init__(
            ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
            retries=-1,
            supported_errors=(redis.ConnectionError, redis.TimeoutError),
        )
        self.timeout_s = timeout_s
        self.shown_url = shown_url

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        deadline = None
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if _fatal(error) or (is_retryable and not is_retryable(error)):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now >= deadline:
                    raise BrokerUnavailable(
                        f"cannot reach Redis at {self.shown_url} after {failures} attempts in "
                        f"{self.timeout_s:.0f}s ({error.__class__.__name__}: {error}); start "
                        "redis-server or fix redis.url"
                    ) from None
                delay = min(self._backoff.compute(failures), deadline - now)
                log.warning("Redis connection lost (%s); reconnecting in %.1fs", error, delay)
                time.sleep(delay)


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A client for `url` that reconnects with backoff for up to `timeout_s` on every command."""
    shown = redact(url)
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=5,
            health_check_interval=30,
            retry=DeadlineRetry(timeout_s, shown),
        )
    except ValueError as e:
        # the parser's message may quote part of the password: show it only without credentials
        detail = f"({e})" if shown == url else "(percent-encode special characters in the password)"
        raise BrokerUnavailable(f"redis.url {shown} is not a valid Redis URL {detail}") from None
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise BrokerUnavailable(
            f"Redis at {shown} refused the credentials ({e}): check the user "
            "and password in redis.url (rollctl acl prints them)"
        ) from None
    except redis.exceptions.NoPermissionError as e:
        raise BrokerUnavailable(
            f"Redis user in {shown} may not run PING ({e}): apply the ACL rules from rollctl acl"
        ) from None
    except (redis.ConnectionError, OSError) as e:  # only fatal ones get here (DeadlineRetry)
        if "CERTIFICATE" in str(e):
            raise BrokerUnavailable(
                f"TLS to Redis at {shown} failed ({e}): pass the server's "
                "CA as ?ssl_ca_certs=/path/ca.pem in redis.url"
            ) from None
        raise BrokerUnavailable(f"Redis at {shown} refused the connection ({e})") from None
    return client
