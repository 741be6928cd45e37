"""`rollflash.Run` before it trains: how a config and its sections become the run's config, and
how callables among the reward functions become the specs the processes see."""

from pathlib import Path

import pytest

from rollflash.broker.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_sections_replace_keys_and_callables_become_specs():
    from rollflash import Run

    def exact(prompt, response, answer, **row):
        return 1.0

    run = Run(
        ROOT / "configs" / "demo.yaml",
        trainer={"total_steps": 5},
        rollout={"vllm": {"max_num_seqs": 4}},
        reward={"functions": ["math", exact, lambda *a, **k: 0.0, lambda *a, **k: 1.0]},
    )
    cfg = run.config
    assert cfg.trainer.total_steps == 5 and cfg.trainer.rollout_batch_size == 32  # the file's
    assert cfg.rollout.vllm.max_num_seqs == 4 and cfg.rollout.temperature == 1.0
    assert cfg.reward.functions == ["math", "python:exact", "python:lambda", "python:lambda_2"]
    assert set(run.functions) == {"python:exact", "python:lambda", "python:lambda_2"}
    # what the file leaves open stays open: rollctl run still chooses the generator count
    assert "num_rollout_workers" not in cfg.rollout.model_fields_set
    again = Run(load_config(ROOT / "configs" / "demo.yaml")).config
    assert "num_rollout_workers" not in again.rollout.model_fields_set


def test_bad_sections_and_callables_with_several_ranks_are_one_line():
    from rollflash import Run

    with pytest.raises(ConfigError, match=r"^trainer: expected a mapping of the section's keys"):
        Run(None, trainer=5)
    with pytest.raises(ConfigError, match=r"^trainer.total_stepz: unknown key"):
        Run(None, trainer={"total_stepz": 5})
    with pytest.raises(ConfigError, match=r"^trainer.num_trainer_workers: reward functions given"):
        Run(None, trainer={"num_trainer_workers": 2}, reward={"functions": [lambda *a: 1.0]})
