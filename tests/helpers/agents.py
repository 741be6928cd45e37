"""Agent programs for the tests of `rollout.agent` (importable by a generator as
"tests.helpers.agents:<name>")."""

from __future__ import annotations

import time


def two_calls(client, item):
    """Two chat calls, the second extending the first with a tool result; reward 1."""
    messages = [{"role": "user", "content": item.prompt}]
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "tool", "content": f"result {turn}"})
    return {"reward": 1.0, "metrics": {"turns": 2}}


def slow(client, item):
    """One call, then 1.5 s of the agent's own work."""
    client.completions.create(model="policy", prompt=item.prompt, max_tokens=2)
    time.sleep(1.5)
    return 1.0
