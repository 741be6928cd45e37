"""The learner's seams for tests and benchmarks (learner/process/hooks.py,
learner/models/simulated.py): a fault test's hook enters through the environment the learner starts
with, the simulated policy through the config, and the visible loop (learner/loop.py) names neither.
Unit tests of that code; the fault tests (tests/faults/test_learner_faults.py) stop real learners
through the same hook."""

import ast
from pathlib import Path

import pytest
import torch

from rollflash.broker.config.config import config_from_dict
from rollflash.errors import BadInput
from rollflash.learner.build import build_models, build_optim
from rollflash.learner.models.simulated import SimulatedPolicy
from rollflash.learner.process.dist import Dist
from rollflash.learner.process.hooks import HOOK_ENV, POINTS, hooks_from_env

LOOP = Path(__file__).resolve().parents[2] / "learner" / "loop.py"


def test_the_hook_the_environment_names_runs_at_every_point(tmp_path, monkeypatch):
    (tmp_path / "my_fault_hook.py").write_text(
        "seen = []\n\ndef record(point, step):\n    seen.append((point, step))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = hooks_from_env({HOOK_ENV: "my_fault_hook:record"})
    hooks.at("after_read", 3)
    hooks.at("before_ack", 4)
    import my_fault_hook

    assert my_fault_hook.seen == [("after_read", 3), ("before_ack", 4)]


def test_without_the_variable_no_hook_runs():
    assert hooks_from_env({}).hooks == () and hooks_from_env({HOOK_ENV: ""}).hooks == ()


@pytest.mark.parametrize("spec", ["no_such_module_x:f", "json:no_such_function"])
def test_a_hook_that_cannot_be_found_is_one_line_naming_the_variable(spec):
    with pytest.raises(BadInput, match=rf"^\${HOOK_ENV}={spec}: no function"):
        hooks_from_env({HOOK_ENV: spec})


def test_the_simulated_policy_comes_from_the_config_with_the_real_step_interface():
    cfg = config_from_dict({"sim": {"learner_step_s": 0.001}})
    models = build_models(cfg, Dist())
    assert isinstance(models.policy, SimulatedPolicy)
    optim = build_optim(cfg, models)
    # the arguments learner/loop.py `train` passes to learner/step/train.py's train_step
    stats = models.train_step(models.model, optim.optimizer, [], cfg, models.algo, Dist())
    assert stats == {"loss/policy": 0.0}
    torch.testing.assert_close(models.policy.weight, torch.ones(4))  # one step: 0 + 1


def test_the_loop_names_neither_the_simulator_nor_a_fault_point():
    tree = ast.parse(LOOP.read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"rollflash.learner.models.simulated", "rollflash.learner.process.hooks"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {n for n in names if "simulat" in n.lower() or n in ("hooks", "pause_point")}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not strings & set(POINTS)
