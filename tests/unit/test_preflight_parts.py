"""rollctl/preflight.py: what each role needs, checked before anything starts; unit tests of its
parts (the commands' own paths: tests/e2e/test_preflight.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from rollflash.broker.config.config import ConfigError, load_config
from rollflash.envs.reward_functions import RewardFunctionError
from rollflash.errors import BadInput, MissingFile
from rollflash.rollctl import preflight as pf


@pytest.fixture
def gpus(monkeypatch):
    """Set how many NVIDIA GPUs this machine reports."""

    def have(n: int | None) -> None:
        monkeypatch.setattr(pf, "gpu_count", lambda: n)

    return have


def test_gpu_ids_and_devices_must_be_on_this_machine(gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    layout = load_config(None, ["placement.gpus='0-3'", "placement.learner_gpus=1"])
    gpus(4)
    pf.check_gpus(layout, learner=True, generator=True)
    gpus(2)
    with pytest.raises(ConfigError) as e:
        pf.check_gpus(layout, learner=True, generator=True)
    assert str(e.value) == "placement.gpus: needs 4 GPU(s), and this machine has 2 GPU(s)"
    cuda = load_config(None, ["trainer.device=cuda"])
    gpus(0)
    with pytest.raises(ConfigError, match="^trainer.device: needs 1 GPU.*has no NVIDIA GPU$"):
        pf.check_gpus(cuda, learner=True, generator=False)
    pf.check_gpus(cuda, learner=False, generator=True)  # a generator computes where it says
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="^trainer.device: cuda, but CUDA_VISIBLE_DEVICES"):
        pf.check_gpus(cuda, learner=True, generator=False)
    gpus(None)  # nvidia-smi failed: nothing is claimed about the machine
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    pf.check_gpus(cuda, learner=True, generator=True)


def _dataset_cfg(tmp_path, *sets: str):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i)}) + "\n"
                            for i in range(8)))  # fmt: skip
    base = [
        "task.name=dataset",
        f"task.params={{path: {data}, prompt_key: question}}",
        "reward.functions=[exact]",
        f"model.path={tmp_path / 'no-model'}",
    ]
    return load_config(None, base + list(sets))


def test_each_role_checks_what_it_needs(tmp_path, gpus, monkeypatch):
    gpus(0)
    monkeypatch.delenv(pf.PREFLIGHT_DONE_ENV, raising=False)
    cfg = _dataset_cfg(tmp_path)
    with pytest.raises(MissingFile, match="^model.path: no Hugging Face model directory"):
        pf.preflight(cfg, ["learner"])
    with pytest.raises(MissingFile, match="^model.path"):
        pf.preflight(cfg, ["generator"])
    simulated = _dataset_cfg(tmp_path, "sim.learner_step_s=0.1", "rollout.engine=sim")
    pf.preflight(simulated, ["learner", "generator"])  # neither loads the model
    missing = _dataset_cfg(
        tmp_path, "sim.learner_step_s=0.1", "rollout.engine=sim", "task.params.path=nope.jsonl"
    )
    pf.preflight(missing, ["generator"])  # a generator never reads the rows
    with pytest.raises(MissingFile, match="^task.params.path: no such file or directory"):
        pf.preflight(missing, ["learner"])
    monkeypatch.setenv(pf.PREFLIGHT_DONE_ENV, "1")  # checked by `rollctl run` already
    pf.preflight(cfg, ["learner", "generator"])


def test_a_mixtures_dataset_components_are_checked_under_their_keys(tmp_path, gpus):
    gpus(0)
    task = {
        "name": "mixture",
        "params": {
            "components": [
                {"task": "arithmetic"},
                {"task": "dataset", "params": {"path": str(tmp_path / "none.jsonl")},
                 "reward": {"functions": ["exact"]}},
            ]
        },
    }  # fmt: skip
    cfg = load_config(None, [f"task={json.dumps(task)}", "sim.learner_step_s=0.1"])
    with pytest.raises(MissingFile) as e:
        pf.preflight(cfg, ["learner"])
    assert str(e.value) == (
        f"task.params.components[1].params.path: no such file or directory: {tmp_path}/none.jsonl"
    )


def test_reward_import_strings_are_imported_as_the_children_import_them(
    tmp_path, gpus, monkeypatch
):
    gpus(0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "pf_rewards", None)  # so that teardown forgets the import
    del sys.modules["pf_rewards"]
    (tmp_path / "pf_rewards.py").write_text(
        "def score(prompt, response, answer, **row):\n    return 1.0\n"
    )
    sets = ["sim.learner_step_s=0.1", "rollout.engine=sim"]
    bad = _dataset_cfg(tmp_path, *sets, "reward.functions=['pf_rewards:nope']")
    with pytest.raises(RewardFunctionError) as e:
        pf.preflight(bad, ["generator"], children_env={})
    assert str(e.value).startswith(
        "reward.functions[0]: cannot import pf_rewards:nope (AttributeError: module "
    )
    good = _dataset_cfg(tmp_path, *sets, "reward.functions=['pf_rewards:score']")
    path, environ = list(sys.path), dict(os.environ)
    pf.preflight(good, ["generator"], children_env={"ROLLFLASH_X": "1"})  # `python -m`: cwd
    assert sys.path == path and dict(os.environ) == environ  # put back as they were


def test_an_unknown_task_parameter_is_one_line(tmp_path, gpus):
    gpus(0)
    cfg = _dataset_cfg(tmp_path, "sim.learner_step_s=0.1", "task.params.shufle=true")
    with pytest.raises(BadInput, match="^unknown parameter 'shufle' for task 'dataset'"):
        pf.preflight(cfg, ["learner"])
