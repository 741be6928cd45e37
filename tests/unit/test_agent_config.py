"""`rollout.agent` in the config: what it cannot be combined with, each refused in one line."""

import pytest

from rollflash.broker.config.config import ConfigError, config_from_dict

AGENT = {"agent": "examples.guess_sum:run_episode"}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"reward": {"functions": ["math"]}}, "rollout.agent: the agent's return is the episode's"),
        ({"reward": {"type": "model", "model_path": "rm"}}, "keep reward.type: rule"),
        ({"rollout": {**AGENT, "inflight_samples": 8, "engine": "vllm"}},
         "rollout.inflight_samples: agent episodes run in pulls"),
        ({"trainer": {"strategy": "fsdp"}}, "trainer.strategy: the learner evaluates agent"),
    ],
)  # fmt: skip
def test_refused_combinations(data, message):
    data = {"rollout": AGENT, **data}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_a_dataset_task_needs_no_reward_functions_with_an_agent():
    task = {"name": "dataset", "params": {"path": "data/x.jsonl"}}
    with pytest.raises(ConfigError, match="task 'dataset' has no verifier"):
        config_from_dict({"task": task})
    assert config_from_dict({"task": task, "rollout": AGENT}).rollout.agent == AGENT["agent"]
