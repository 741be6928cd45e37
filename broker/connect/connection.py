"""Connecting to Redis, and staying connected through restarts.

`connect(url, timeout_s)` returns a client whose every command rides out a lost connection: it
reconnects with exponential backoff (0.2 s doubling to 5 s, broker/connect/retry.py) for up to
`timeout_s`, then raises `BrokerUnavailable` naming the (password-masked) URL.
So a Redis restart shorter than `redis.connect_timeout_s` is invisible to callers apart from the
wait: the learner, the generators and `rollctl status` all get this from `connect`. Only the first
contact is shorter: a Redis that is not there when a process starts (connection refused, no such
socket) is reported after `STARTUP_TIMEOUT_S` (1 s) of retries, not after the whole timeout, since
waiting longer rarely helps a process that never reached it.

A command retried after a lost connection may have run once already (the reply was lost): that is
why trajectories are at-least-once and the learner drops duplicates by `traj_id`
(broker/channels/trajectories.py). `ReconnectRetry.failures` counts such attempts, so a writer can tell
which of its writes are indeterminate.

Errors that retrying cannot fix fail at once with one line naming the cause: a wrong user or
password, a missing permission, a TLS certificate the client does not trust. The URL in every
message has its password masked.

URLs: `redis://[user:password@]host:port[/db]`, `rediss://...` for TLS (add
`?ssl_ca_certs=/path/ca.pem` for a private CA, `&ssl_certfile=...&ssl_keyfile=...` for client
certificates), `unix://[user:password@]/path/redis.sock`. Behind Sentinel (`redis.sentinel.hosts`)
the URL gives only the user, password, database and TLS settings; the master's address comes from
the Sentinels, and writes return once replicated (broker/connect/sentinel.py). The Sentinels themselves
are reached without a password.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollflash.broker.connect.retry import retry_until
from rollflash.broker.connect.secrets import redact
from rollflash.broker.connect.sentinel import master_client
from rollflash.errors import RollflashError

if TYPE_CHECKING:
    from rollflash.broker.config.config_run import SentinelConfig

T = TypeVar("T")

log = logging.getLogger(__name__)


class BrokerUnavailable(RollflashError, RuntimeError):
    """Redis could not be reached (or refused writes) within the allowed time."""


def _fatal(e: BaseException) -> bool:
    """Connection errors that another attempt cannot fix (credentials, TLS trust)."""
    if isinstance(e, redis.AuthenticationError):
        return True
    text = str(e)
    return "CERTIFICATE_VERIFY_FAILED" in text or "WRONGPASS" in text or "NOAUTH" in text


_RECONNECT_ERRORS = (redis.ConnectionError, redis.TimeoutError)
STARTUP_TIMEOUT_S = 1.0  # retries of the first contact (module docstring)


class ReconnectRetry(Retry):
    """What redis-py runs around every command, pipeline and reconnect: the project's retry policy
    (broker/connect/retry.py), which gives up `timeout_s` after the first failure with `BrokerUnavailable`.
    redis-py's own `Retry` counts attempts, which says nothing about how long Redis may be down.

    It overrides only the public `call_with_retry` that redis-py calls; the base class is built
    with no backoff and no limit and holds nothing this class reads. redis-py deep-copies a
    client's retry into each connection; this one is shared instead (`__deepcopy__`), so that
    `connect` can lengthen the timeout of every connection once the first contact succeeded."""

    def __init__(self, timeout_s: float, shown_url: str):
        super().__init__(NoBackoff(), retries=-1, supported_errors=_RECONNECT_ERRORS)
        self.timeout_s = timeout_s
        self.shown_url = shown_url
        self.failures = 0  # attempts that lost their connection: their commands may have run

    def __deepcopy__(self, memo: dict[int, Any]) -> ReconnectRetry:
        return self  # no state per connection: the policy and the shown URL

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retry_if(e: Exception) -> bool:
            return (
                isinstance(e, _RECONNECT_ERRORS)
                and not _fatal(e)
                and (is_retryable is None or is_retryable(e))
            )

        def on_failure(e: Exception, failures: int) -> None:
            self.failures += 1
            if with_failure_count:  # redis-py's callback: it closes the broken connection
                fail(e, failures)
            else:
                fail(e)

        def give_up(e: Exception, failures: int) -> Exception:
            return BrokerUnavailable(
                f"cannot reach Redis at {self.shown_url} after {failures} attempts in "
                f"{self.timeout_s:.0f}s ({e.__class__.__name__}: {e}); start "
                "redis-server or fix redis.url"
            )

        return retry_until(
            do,
            timeout_s=self.timeout_s,
            retry_if=retry_if,
            give_up=give_up,
            warn="Redis connection lost (%s); reconnecting in %.1fs",
            on_failure=on_failure,
            logger=log,
        )


def connect(url: str, timeout_s: float, sentinel: SentinelConfig | None = None) -> redis.Redis:
    """A client for `url` that reconnects with backoff for up to `timeout_s` on every command;
    the first contact gives up after `STARTUP_TIMEOUT_S` (module docstring). With `sentinel`
    hosts, the master the Sentinels name, whose writes return once replicated
    (broker/connect/sentinel.py)."""
    shown = redact(url)
    if sentinel is not None and sentinel.hosts:
        shown = f"{shown} (master {sentinel.service!r} of Sentinels {', '.join(sentinel.hosts)})"
    retry = ReconnectRetry(min(timeout_s, STARTUP_TIMEOUT_S), shown)
    options: dict[str, Any] = {"socket_connect_timeout": 5, "health_check_interval": 30}
    try:
        if sentinel is not None and sentinel.hosts:
            client: redis.Redis = master_client(
                url, sentinel.hosts, sentinel.service, sentinel.replicas, retry=retry, **options
            )
        else:
            client = redis.Redis.from_url(url, retry=retry, **options)
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
    except (redis.ConnectionError, OSError) as e:  # only fatal ones get here (ReconnectRetry)
        if "CERTIFICATE" in str(e):
            raise BrokerUnavailable(
                f"TLS to Redis at {shown} failed ({e}): pass the server's "
                "CA as ?ssl_ca_certs=/path/ca.pem in redis.url"
            ) from None
        raise BrokerUnavailable(f"Redis at {shown} refused the connection ({e})") from None
    retry.timeout_s = timeout_s  # connected once: from now on a lost connection is waited out
    return client
