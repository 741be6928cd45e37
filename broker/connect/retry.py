"""The one retry policy for waiting out Redis: exponential backoff from 0.2 s, doubling up to 5 s,
until `timeout_s` after the first failure, then one error the caller builds (`BrokerUnavailable`
with a message that names the cause and the fix).

Every wait in the project uses it:
- a lost connection: broker/connect/connection.py hands it to redis-py, which calls it around every
  command, pipeline and reconnect;
- writes Redis refuses at maxmemory ("OOM ..."): broker/connect/redis_io.py;
- a generator's turn that hit either: generators/rollout.py.

Why a helper and not tenacity: it is a dozen lines, it sits on the path of every Redis command,
and it needs what tenacity does not give directly: the deadline counts from the first failure
(not from the call's start, which for a blocking read may be long before) and the last sleep is cut
to the deadline, so a caller gives up at `timeout_s`, not up to one backoff step later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FIRST_DELAY_S = 0.2
MAX_DELAY_S = 5.0

_log = logging.getLogger(__name__)


def backoff_delay(failures: int) -> float:
    """Seconds to wait after the `failures`-th failure in a row (1-based): 0.2, 0.4, ... 5."""
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (failures - 1))


def retry_until(
    call: Callable[[], T],
    *,
    timeout_s: float,
    retry_if: Callable[[Exception], bool],
    give_up: Callable[[Exception, int], Exception],
    warn: str,
    on_failure: Callable[[Exception, int], object] | None = None,
    logger: logging.Logger = _log,
) -> T:
    """Return `call()`, calling it again after each error `retry_if` accepts, with backoff.

    `give_up(error, failures)` builds what is raised (from None) once `timeout_s` has passed since
    the first failure; other errors propagate at once. `warn` is a log format with two slots,
    the error and the delay ("Redis connection lost (%s); reconnecting in %.1fs").
    `on_failure(error, failures)` runs after every accepted error, before the wait."""
    deadline: float | None = None
    failures = 0
    while True:
        try:
            return call()
        except Exception as error:
            if not retry_if(error):
                raise
            failures += 1
            if on_failure is not None:
                on_failure(error, failures)
            now = time.monotonic()
            deadline = now + timeout_s if deadline is None else deadline
            if now >= deadline:
                raise give_up(error, failures) from None
            delay = min(backoff_delay(failures), deadline - now)
            logger.warning(warn, error, delay)
            time.sleep(delay)
