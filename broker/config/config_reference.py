"""The config reference, read from the pydantic models themselves so that it cannot drift.

Every key's type, bounds, default and one-line description are the `Field(...)` of its section
(broker/config/config_sections.py, config_algo.py, config_logging.py). Three views are built from them:
`rollctl config show` (with the current value of a loaded config), `rollctl config schema` (JSON
Schema, for editors) and docs/config.md (scripts/gen_config_docs.py; a unit test fails when the
committed file differs from what the models give). Importing this module imports no torch.
"""

from __future__ import annotations

import inspect
import json
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rollflash.broker.config.config import Config
from rollflash.broker.config.config_errors import bounds_text

SCHEMA_ID = "https://json-schema.org/draft/2020-12/schema"


@dataclass(frozen=True)
class KeyDoc:
    """One config key: `section.key`, its type and bounds in words, its default and its doc."""

    key: str
    type: str
    default: Any
    doc: str


@dataclass(frozen=True)
class SectionDoc:
    name: str
    doc: str  # the one-line description of the section's field in `Config`
    detail: str  # the section class's docstring, joined into one paragraph ("" if none)
    keys: list[KeyDoc]


def reference(root: type[BaseModel] = Config) -> list[SectionDoc]:
    """Every section of the config with its keys, in declaration order."""
    sections = []
    for name, info in root.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), name
        keys = _keys(name, model)
        detail = " ".join(inspect.cleandoc(model.__doc__ or "").split())
        sections.append(SectionDoc(name, info.description or "", detail, keys))
    return sections


def _nested(info: FieldInfo) -> type[BaseModel] | None:
    """The model of a field that is itself a section of keys (e.g. `rollout.vllm`), else None."""
    a = info.annotation
    return a if isinstance(a, type) and issubclass(a, BaseModel) else None


def _keys(prefix: str, model: type[BaseModel]) -> list[KeyDoc]:
    """The keys of `model` under `prefix`, a nested section's keys under `prefix.name`."""
    out = []
    for key, f in model.model_fields.items():
        nested = _nested(f)
        if nested is not None:
            out += _keys(f"{prefix}.{key}", nested)
        else:
            out.append(KeyDoc(f"{prefix}.{key}", type_text(f), default_of(f), f.description or ""))
    return out


def default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else info.default


def type_text(info: FieldInfo) -> str:
    """`float > 0`, `int >= 0`, `str or null`, `one of grpo, rloo`: the annotation and bounds."""
    words = _annotation_text(info.annotation)
    bounds = bounds_text(info, with_null=False)
    if not bounds:
        return words
    if words.endswith(" or null"):
        return f"{words.removesuffix(' or null')} {bounds} or null"
    return f"{words} {bounds}"


def _annotation_text(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _annotation_text(args[0])
    if origin is Literal:
        return "one of " + ", ".join(value_text(a) for a in args)
    if origin in (list, tuple):
        inner = _annotation_text(args[0]) if args else "any"
        return f"list, each {inner}" if inner.startswith("one of") else f"list of {inner}"
    if origin is dict:
        return "mapping"
    if args:  # a union: X | None
        kinds = [_annotation_text(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        return " or ".join(kinds) + (" or null" if nullable else "")
    names = {int: "int", float: "float", bool: "bool", str: "str", dict: "mapping"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def value_text(value: Any) -> str:
    """A value as YAML writes it in flow style: `null`, `true`, `0.0001`, `[jsonl, tensorboard]`."""
    if isinstance(value, str) and "\n" in value:  # one line: a JSON string is YAML too
        return json.dumps(value)
    text = yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()
    return text[1:-1]  # the one-item list's brackets


def show_lines(cfg: Config | None = None) -> list[str]:
    """`rollctl config show`: the config as YAML, every key with its current value and, in a
    comment, its type, its default (`*` marks a value that differs from it) and its doc. The
    Redis URL is shown without its password; the text parses back to `cfg.public_dict()`."""
    data = (cfg or Config()).public_dict()
    out: list[str] = []
    for section in reference():
        out.append(f"{section.name}:  # {section.doc}")
        opened = ""  # the nested section (e.g. `vllm` of rollout) whose header was printed last
        for k in section.keys:
            *parents, name = k.key.split(".")[1:]
            current = data[section.name]
            for parent in parents:
                current = current[parent]
            if parents and parents[0] != opened:
                opened = parents[0]
                out.append(f"  {opened}:")
            current = current[name]
            mark = " " if current == k.default else "*"
            entry = "  " * (1 + len(parents)) + f"{name}: {value_text(current)}"
            out.append(f"{entry:<40} #{mark}{k.type}; default {value_text(k.default)}; {k.doc}")
    return out


def json_schema() -> dict[str, Any]:
    """The config's JSON Schema, for editors (YAML language servers) and other tools."""
    schema = Config.model_json_schema()
    models = [typing.cast(type[BaseModel], i.annotation) for i in Config.model_fields.values()]
    while models:  # defaults made by a factory are left out: add them, nested sections too
        model = models.pop()
        props = schema["$defs"][model.__name__]["properties"]
        for key, field in model.model_fields.items():
            nested = _nested(field)
            if nested is not None:
                models.append(nested)
            else:
                props[key].setdefault("default", default_of(field))
    return {"$schema": SCHEMA_ID, **schema, "title": "rollflash run config"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/config.md."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the pydantic models in broker/config*.py;",
        "     edit the Field descriptions there, then run the script. tests/unit/test_config_docs.py",
        "     fails when this file is stale. -->",
        "",
        "Every key of the run YAML, by section. A key not in the file takes its default; an unknown",
        "key, a wrong type or an out-of-range value fails at load with one line naming the key.",
        "`--set section.key=value` overrides any key from the command line.",
        "",
        "- `rollctl config show [--config FILE]` prints this table with the values of a config file.",
        "- `rollctl config schema > rollflash.schema.json` writes the JSON Schema; with the YAML",
        "  language server (VS Code's YAML extension, neovim's yamlls) the first line",
        "  `# yaml-language-server: $schema=rollflash.schema.json` of a config gives completion,",
        "  hover docs and validation.",
        "",
    ]
    for section in reference():
        lines += [f"## `{section.name}:` {section.doc}", ""]
        if section.detail:
            lines += [section.detail, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in section.keys:
            name = k.key.split(".", 1)[1]
            lines.append(
                f"| `{name}` | {_cell(k.type)} | `{_cell(value_text(k.default))}` | {_cell(k.doc)} |"
            )
        lines.append("")
    return "\n".join(lines + _agreement())


def _agreement() -> list[str]:
    """docs/config.md's last section: the keys of the fingerprint (broker/config/fingerprint.py)."""
    from rollflash.broker.config.fingerprint import LOCAL, SHARED

    shared = [
        f"`{section}.*`" if keys is None else ", ".join(f"`{section}.{k}`" for k in keys)
        for section, keys in SHARED.items()
    ]
    return [
        "## What every process of a run must agree on",
        "",
        "The learner records these keys and their values in the run's Redis hash (the config",
        "fingerprint); a generator, or a learner resuming the run, whose values differ is refused",
        "with one line naming each key that differs and both values:",
        "",
        *(f"- {line}" for line in shared),
        "",
        "except " + ", ".join(f"`{k}`" for k in sorted(LOCAL)) + " (how one process runs).",
        "",
        "Every other key may differ between the processes of a run, and between a run and its",
        "resumption: `trainer.total_steps` (extend a run by resuming it with a larger one) and the",
        "rest of `trainer:`, `algo:`, `eval:` (its cadence `eval.every` included), `logging:`,",
        "`guards:`, `placement:`, `sim:`, `rm:`, `run:`, the Redis URL and timeouts, and a",
        "generator's engine and its options (`rollout.engine`, `rollout.device`, `rollout.vllm`,",
        "`rollout.inflight_samples`, `rollout.interrupt`, `rollout.prompts_per_pull`,",
        "`rollout.redundant_samples`, `rollout.reclaim_idle_s`, `rollout.heartbeat_ttl_s`) and",
        "the number of generators (`rollout.num_rollout_workers`). So a `vllm` or `sim` generator",
        "joins a run configured for `hf`. The `hf` and `vllm` engines report the same behaviour",
        "log-probabilities, log_softmax(logits / temperature) before top-p truncation",
        "(generators/sampling.py); the `sim` engine's are a constant -1 (scheduling benchmarks).",
        "",
    ]
