"""A verifiers (Prime Intellect's environment library) environment trained through the agent
endpoint (docs/agentic.md, "verifiers environments").

    rollout:
      agent: examples.verifiers_env:run_episode

`run_episode` builds a verifiers v1 single-agent environment over this module's taskset
(`SumTaskset`: one task per item, the item's prompt, an exact-match `@reward` on its answer,
read from <answer> tags when the reply has them) and
runs one episode of it with verifiers' own machinery: its `null` harness (a chat program that
verifiers starts as a uv script) talks to verifiers' interception server, which relays every
model request to the endpoint's URL for this episode. The trace's reward is the episode's.

verifiers 0.4 pins openai<3, rollflash's `agent` extra installs openai 3, so this runs in a
virtualenv of its own (`make verifiers-venv`: .venv-verifiers with verifiers and its openai, and
.venv's packages after them, rollflash and torch included), started from the repository root:

    .venv-verifiers/bin/rollctl run --config configs/verifiers_env.yaml
"""

from __future__ import annotations

import os
import re
import sys

import verifiers.v1 as vf
from verifiers.v1.env import RunSlot
from verifiers.v1.types import content_text
from verifiers.v1.utils.decorators import reward
from verifiers.v1.utils.loaders import load_environment

__all__ = ["SumTaskset", "run_episode"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 when the last reply's answer (inside <answer> tags if it has them) is the item's."""
        replies = [n.message for n in trace.nodes if n.message.role == "assistant"]
        text = content_text(replies[-1].content) if replies else ""
        tagged = re.findall(r"<answer>\s*(.*?)\s*</answer>", text, flags=re.DOTALL)
        return float((tagged[-1] if tagged else text.strip()) == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        return iter(())  # tasks come from rollflash's items, one per episode


_ENV = None
# verifiers resolves a taskset id to a top-level module (a dotted id makes it look for a
# `verifiers.v1.tasksets.<first part>` package): this one, under a plain name
TASKSET_ID = "rollflash_sum_taskset"
sys.modules.setdefault(TASKSET_ID, sys.modules[__name__])
os.environ.setdefault("ROLLFLASH_KEY", "rollflash")  # verifiers reads the API key from a variable


async def run_episode(client, item) -> float:
    """One verifiers episode of `item` against this episode's endpoint URL."""
    global _ENV
    if _ENV is None:
        from verifiers.v1.harnesses.null import NullHarnessConfig
        from verifiers.v1.runtimes.subprocess import SubprocessConfig

        # the `null` harness (a plain chat program) in a local subprocess, not a Prime box
        agent = vf.AgentConfig(harness=NullHarnessConfig(id="null"), runtime=SubprocessConfig(),
                               max_turns=1)  # fmt: skip
        config = vf.SingleAgentEnvConfig(taskset=vf.TasksetConfig(id=TASKSET_ID), agent=agent)
        _ENV = load_environment(config)
    task = SumTask(SumData(prompt=item.prompt, answer=item.answer))
    ctx = vf.ModelContext(
        model="policy",
        client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var="ROLLFLASH_KEY"),
    )
    async with _ENV.serving():
        episode = await _ENV.run_slot(RunSlot(task), ctx)
    if episode.errors:
        raise RuntimeError(f"verifiers episode failed: {episode.errors[-1]}")
    return sum(trace.reward for trace in episode.traces)
