"""Connecting to Redis with bounded retries.

A process that cannot reach Redis retries with exponential backoff (0.2 s doubling to 5 s) and,
after `timeout_s`, raises `BrokerUnavailable` whose message names the URL and what to check.
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """Redis could not be reached within the allowed time."""


def connect(url: str, timeout_s: float) -> redis.Redis:
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    attempt = 0
    while True:
        attempt += 1
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
            client.ping()
            return client
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrokerUnavailable(
                    f"cannot reach Redis at {url} after {attempt} attempts in {timeout_s:.0f}s "
                    f"({e.__class__.__name__}); start redis-server or fix redis.url") from None
            log.warning("Redis at %s unreachable (%s); retrying in %.1fs", url, e, delay)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
