"""The one retry policy (broker/connect/retry.py) and its two users in broker/, on a fake clock: which
errors are retried, the backoff sequence, and the error raised at the deadline."""

import pytest
import redis

from rollflash.broker.connect import retry
from rollflash.broker.connect.connection import BrokerUnavailable, ReconnectRetry
from rollflash.broker.connect.redis_io import REFUSED_ATTEMPTS, RunRedis, WriteRefused, is_oom


class FakeClock:
    """time.monotonic and time.sleep: sleeping moves the clock, calls take no time."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 6))
        self.now += s


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(retry, "time", c)
    return c


def failing(times: int, error: Exception, result: str = "ok"):
    calls = {"n": 0}

    def call() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error
        return result

    return call, calls


def _give_up(e: Exception, failures: int) -> Exception:
    return BrokerUnavailable(f"gave up after {failures}: {e}")


def test_backoff_doubles_from_0_2_s_up_to_5_s():
    # 0.2 * 2^(k-1): 0.2, 0.4, 0.8, 1.6, 3.2, then 6.4 > 5 is capped
    assert [retry.backoff_delay(k) for k in range(1, 9)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5, 5, 5]


def test_retried_errors_are_waited_out_with_backoff(clock):
    call, calls = failing(3, ValueError("down"))
    seen = []
    out = retry.retry_until(
        call,
        timeout_s=30,
        retry_if=lambda e: isinstance(e, ValueError),
        give_up=_give_up,
        warn="%s %s",
        on_failure=lambda e, n: seen.append(n),
    )
    assert out == "ok" and calls["n"] == 4
    assert clock.slept == [0.2, 0.4, 0.8] and seen == [1, 2, 3]


def test_the_deadline_counts_from_the_first_failure_and_cuts_the_last_wait(clock):
    call, calls = failing(100, ValueError("down"))
    with pytest.raises(BrokerUnavailable, match="^gave up after 4: down$") as info:
        retry.retry_until(
            call,
            timeout_s=1.0,
            retry_if=lambda e: True,
            give_up=_give_up,
            warn="%s %s",
        )
    # failures at t = 0, 0.2, 0.6 (waits 0.2, 0.4), then the 0.8 s wait is cut to the 0.4 s
    # left; the 4th failure at t = 1.0 is at the deadline: give up
    assert clock.slept == [0.2, 0.4, 0.4] and calls["n"] == 4
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_other_errors_propagate_at_once(clock):
    call, calls = failing(1, KeyError("bug"))
    with pytest.raises(KeyError):
        retry.retry_until(
            call,
            timeout_s=30,
            retry_if=lambda e: isinstance(e, ValueError),
            give_up=_give_up,
            warn="%s %s",
        )
    assert calls["n"] == 1 and clock.slept == []


def test_reconnect_policy_gives_up_with_the_url_and_attempts(clock):
    policy = ReconnectRetry(timeout_s=1.0, shown_url="redis://u:***@h:1")
    closed = []
    call, _ = failing(100, redis.ConnectionError("refused"))
    with pytest.raises(BrokerUnavailable) as info:
        policy.call_with_retry(call, lambda e, n: closed.append(n), with_failure_count=True)
    assert str(info.value) == (
        "cannot reach Redis at redis://u:***@h:1 after 4 attempts in 1s "
        "(ConnectionError: refused); start redis-server or fix redis.url"
    )
    assert closed == [1, 2, 3, 4]  # redis-py's callback closed the connection after each failure


def test_reconnect_policy_succeeds_once_redis_is_back(clock):
    policy = ReconnectRetry(timeout_s=30, shown_url="unix:///r.sock")
    call, calls = failing(2, redis.TimeoutError("slow"), result="PONG")
    assert policy.call_with_retry(call, lambda e: None) == "PONG"
    assert calls["n"] == 3 and clock.slept == [0.2, 0.4]


@pytest.mark.parametrize(
    "error",
    [
        redis.AuthenticationError("invalid username-password pair"),
        redis.ConnectionError("WRONGPASS invalid username-password pair"),
        redis.ConnectionError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
    ],
)
def test_reconnect_policy_does_not_retry_what_waiting_cannot_fix(clock, error):
    call, calls = failing(100, error)
    with pytest.raises(type(error)):
        ReconnectRetry(30, "unix:///r.sock").call_with_retry(call, lambda e: None)
    assert calls["n"] == 1 and clock.slept == []


def test_reconnect_policy_honours_redis_py_is_retryable(clock):
    call, calls = failing(100, redis.ConnectionError("down"))
    with pytest.raises(redis.ConnectionError):
        ReconnectRetry(30, "unix:///r.sock").call_with_retry(
            call, lambda e: None, is_retryable=lambda e: False
        )
    assert calls["n"] == 1


def test_writes_refused_at_maxmemory_are_retried_then_reported(clock):
    io = RunRedis(client=None, run_id="r", busy_timeout_s=3)  # type: ignore[arg-type]
    oom = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'")
    assert is_oom(oom) and is_oom(redis.ResponseError("OOM command not allowed"))
    call, calls = failing(2, oom)
    assert io.write(call) == "ok" and calls["n"] == 3
    call, _ = failing(100, oom)
    with pytest.raises(BrokerUnavailable) as info:
        io.write(call)
    assert str(info.value) == (
        "Redis refused writes for 3s because it is at maxmemory: raise maxmemory or free memory"
    )
    # a write refused for another reason is tried REFUSED_ATTEMPTS = 3 times in all, then
    # reported in one line naming the write and the reason (not waited out for busy_timeout_s)
    call, calls = failing(100, redis.ResponseError("WRONGTYPE Operation against a key"))
    with pytest.raises(WriteRefused) as refused:
        io.write(call, "an acknowledgement")
    assert calls["n"] == REFUSED_ATTEMPTS == 3
    assert str(refused.value) == (
        "Redis refused an acknowledgement of run rl:r: 3 times: WRONGTYPE Operation against a key"
    )
    call, calls = failing(2, redis.ResponseError("ERR something transient"))
    assert io.write(call) == "ok" and calls["n"] == 3
    # and one no retry can cure (a lost lease, a permission) is raised at once
    call, calls = failing(100, redis.ResponseError("NOPERM no"))
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        io.write(call, final=lambda e: str(e).startswith("NOPERM"))
    assert calls["n"] == 1
