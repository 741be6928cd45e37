"""The config reference is read from the models: `rollctl config show` parses back to the config,
the JSON Schema carries every key with its doc and default, and docs/config.md is what the models
give today."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from rollflash.broker.config.config import Config, load_config
from rollflash.broker.config.config_reference import (
    json_schema,
    markdown,
    reference,
    show_lines,
    type_text,
)
from rollflash.broker.config.config_rules import with_algorithms_block
from rollflash.rollctl.cli import app

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_docs_config_md_is_generated_from_the_models():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == markdown(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_docs_algorithms_md_recipe_and_rule_tables_are_generated():
    committed = (ROOT / "docs" / "algorithms.md").read_text()
    assert committed == with_algorithms_block(committed), (
        "docs/algorithms.md's recipe and rule tables are stale: run python scripts/gen_config_docs.py"
    )


def _leaves(model) -> int:
    """Keys of a section, a nested section (rollout.vllm) counted by its own keys."""
    nested = [
        f.annotation for f in model.model_fields.values() if hasattr(f.annotation, "model_fields")
    ]
    return len(model.model_fields) - len(nested) + sum(_leaves(m) for m in nested)


def test_reference_lists_every_field_once_with_its_doc():
    keys = [k for section in reference() for k in section.keys]
    expected = sum(_leaves(info.annotation) for info in Config.model_fields.values())
    assert len(keys) == expected == len({k.key for k in keys})
    by_key = {k.key: k for k in keys}
    assert by_key["trainer.actor_lr"].doc == "AdamW learning rate of the policy"
    assert by_key["trainer.actor_lr"].default == 1e-4
    assert by_key["logging.backends"].default == ["jsonl", "tensorboard"]


@pytest.mark.parametrize(
    "key, expected",
    [
        ("rollout.top_p", "float in (0, 1]"),
        ("algo.dual_clip_c", "float > 1 or null"),
        ("trainer.total_steps", "int > 0"),
        ("redis.url", "str or null"),
        ("rollout.interrupt", "bool"),
        ("model.dtype", "one of auto, float32, bfloat16"),
        ("task.params", "mapping"),
        ("logging.backends", "list, each one of jsonl, tensorboard, wandb, mlflow"),
        ("logging.tags", "list of str"),
    ],
)
def test_type_text_names_the_type_and_bounds(key, expected):
    section, name = key.split(".")
    info = Config.model_fields[section].annotation.model_fields[name]
    assert type_text(info) == expected


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_show_parses_back_to_the_config_and_marks_changed_values(path):
    cfg = load_config(path)
    lines = show_lines(cfg)
    assert yaml.safe_load("\n".join(lines)) == cfg.public_dict()
    changed = {line.split(":")[0].strip() for line in lines if "#*" in line}
    defaults = Config().to_dict()
    expected = set()
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            default = defaults[section][key]
            if (
                isinstance(value, dict)
                and isinstance(default, dict)
                and value.keys() == default.keys()
            ):
                # a nested section (reward.code): show marks its changed keys, not its name
                expected |= {k for k, v in value.items() if v != default[k]}
            elif value != default:
                expected.add(key)
    assert changed == expected


def test_show_never_prints_the_redis_password():
    cfg = load_config(None, ["redis.url=redis://gen:s3cret@host:6379/0"])
    text = "\n".join(show_lines(cfg))
    assert "s3cret" not in text and "url: 'redis://gen@host:6379/0' " in text


def test_schema_has_every_key_with_description_default_and_no_extras():
    schema = json_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(Config.model_fields)
    for section in reference():
        ref = schema["properties"][section.name]["$ref"].rsplit("/", 1)[1]
        definition = schema["$defs"][ref]
        assert definition["additionalProperties"] is False, section.name
        names = list(dict.fromkeys(k.key.split(".")[1] for k in section.keys))
        assert list(definition["properties"]) == names
        for k in section.keys:
            *nested, name = k.key.split(".")[1:]
            props = definition["properties"]
            if nested:  # a nested section's keys are in its own definition
                props = schema["$defs"][props[nested[0]]["$ref"].rsplit("/", 1)[1]]["properties"]
            prop = props[name]
            assert prop["description"] == k.doc and prop["default"] == k.default, k.key
    top_p = schema["$defs"]["RolloutConfig"]["properties"]["top_p"]
    assert (top_p["type"], top_p["exclusiveMinimum"], top_p["maximum"]) == ("number", 0, 1)


def test_cli_config_show_and_schema():
    runner = CliRunner()
    out = runner.invoke(app, ["config", "show", "--config", str(ROOT / "configs" / "dapo.yaml")])
    assert out.exit_code == 0, out.output
    assert "  clip_high: 0.28" in out.output and "#*float > 0; default 0.2;" in out.output
    out = runner.invoke(app, ["config", "schema"])
    assert out.exit_code == 0
    assert json.loads(out.output) == json_schema()
