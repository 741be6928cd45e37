"""The engine table: `rollout.engine` names an import path, and engines import only the sampling
types (and their own helper modules), so neither side needs the other at import time."""

import ast
import importlib.util
from pathlib import Path

import pytest

from rollflash.broker.config.config import ConfigError, config_from_dict
from rollflash.generators.engine import ENGINES, make_engine
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine


def _source(module: str) -> ast.Module:
    """The parsed source of `module`, found without importing it (vllm may not be installed)."""
    return ast.parse(Path(importlib.util.find_spec(module).origin).read_text())


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_in_the_table_is_a_class_with_from_config(name):
    module, _, cls = ENGINES[name].partition(":")
    classes = {n.name: n for n in _source(module).body if isinstance(n, ast.ClassDef)}
    assert cls in classes
    methods = {n.name for n in classes[cls].body if isinstance(n, ast.FunctionDef)}
    assert "from_config" in methods


# what an engine may take from the generator package: the sampling types, and its own helpers
# (device choice, vLLM's start-up arguments, adapter versions and prompt log-probs), which
# import nothing of the package themselves
ENGINE_HELPERS = {
    "rollflash.generators.device",
    "rollflash.generators.vllm_lora",
    "rollflash.generators.vllm_probe",
    "rollflash.generators.vllm_setup",
}


def _generator_imports(module: str) -> set[str]:
    """Modules of the generator package that `module` imports (`from ... import`), where a
    `from rollflash.generators import x` counts as rollflash.generators.x."""
    out = set()
    for node in ast.walk(_source(module)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "rollflash.generators"
        ):
            if node.module == "rollflash.generators":
                out |= {f"rollflash.generators.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_an_engine_imports_nothing_of_the_generator_package_but_the_sampling_types(name):
    imported = _generator_imports(ENGINES[name].partition(":")[0])
    assert "rollflash.generators.sampling" in imported
    assert imported - ENGINE_HELPERS == {"rollflash.generators.sampling"}
    for helper in imported & ENGINE_HELPERS:
        assert _generator_imports(helper) == set(), helper


def test_make_engine_builds_the_named_engine_from_the_config():
    cfg = config_from_dict({"rollout": {"engine": "sim"}, "sim": {"length_median": 5}})
    engine = make_engine(cfg, seed=3)
    assert isinstance(engine, SimEngine)
    assert engine.sim == cfg.sim
    # built with seed 3: it draws the same lengths as a SimEngine built directly with seed 3
    twin = SimEngine(cfg.sim, seed=3)
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=40)
    engine.add_request("k", "p", params)
    twin.add_request("k", "p", params)
    assert [s.length for s in engine._active] == [s.length for s in twin._active]


def test_an_engine_missing_from_the_table_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.delitem(ENGINES, "sim")
    cfg = config_from_dict({"rollout": {"engine": "sim"}})
    with pytest.raises(
        ConfigError, match=r"^rollout.engine: unknown engine 'sim'; use one of hf, vllm$"
    ):
        make_engine(cfg, seed=0)


def test_sampling_params_for_rollout_take_the_rollout_settings_and_the_given_n():
    cfg = config_from_dict({"rollout": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12}})
    assert SamplingParams.for_rollout(cfg.rollout, 5) == SamplingParams(
        n=5, temperature=0.7, top_p=0.9, max_new_tokens=12
    )
