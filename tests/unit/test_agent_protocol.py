"""The agent endpoint's request checks (envs/agent_protocol.py) on their own: a number outside
its range is refused, and NaN, which passes every comparison, and the infinities are outside
every range. (tests/unit/test_agent_endpoint.py drives the same checks through the endpoint.)"""

from __future__ import annotations

import math

import pytest

from rollflash.envs.agent_protocol import Limits, RequestError, params_of

LIMITS = Limits(max_new_tokens=6, max_episode_tokens=120, temperature=0.7, top_p=0.9, max_n=4,
                timeout_s=5.0)  # fmt: skip


@pytest.mark.parametrize("key", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused(key, value):
    with pytest.raises(RequestError, match=f"{key}: must be a finite number") as e:
        params_of({key: value}, LIMITS)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == key


def test_numbers_in_range_pass_and_out_of_range_are_refused():
    p = params_of({"temperature": 2, "top_p": 0.5}, LIMITS)
    assert (p.temperature, p.top_p) == (2.0, 0.5)
    assert params_of({}, LIMITS).temperature == 0.7  # the run's rollout.temperature
    for bad in ({"temperature": 0}, {"temperature": 10**400}, {"top_p": 1.5}, {"top_p": "1"}):
        with pytest.raises(RequestError):
            params_of(bad, LIMITS)
