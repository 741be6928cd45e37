"""`ConfigError` and the one place where pydantic's validation errors become its one-line message.

Every message starts with the dotted key at fault and says what was expected and what was given:
`trainer.actor_lr: expected a number, got 'fast'`, `rollout.top_p: must be in (0, 1], got 1.5`,
`trainer.actor_lrr: unknown key (known: actor_lr, async_ratio, ...)`. A bound is worded from the
field's own constraints (`Field(gt=0, le=1)`), so the message cannot drift from the check.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from rollflash.errors import RollflashError


class ConfigError(RollflashError, ValueError):
    """A config problem; the message starts with the dotted key at fault."""


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a mapping",
    "dict_type": "a mapping",
}
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def config_error(error: ValidationError, root: type[BaseModel]) -> ConfigError:
    """The first of pydantic's errors for a `root.model_validate(...)` call, as a ConfigError."""
    return ConfigError(_message(error.errors()[0], root))


def _message(err: ErrorDetails, root: type[BaseModel]) -> str:
    kind, loc, value = err["type"], err["loc"], err["input"]
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):
        return str(ctx["error"])  # a cross-field rule: its message names its key already
    key = ".".join(str(part) for part in loc) or "config"
    owner = _owner(root, loc)
    info = owner.model_fields.get(str(loc[-1])) if owner is not None and loc else None
    if kind == "extra_forbidden" and owner is not None:
        return f"{key}: unknown key (known: {', '.join(sorted(owner.model_fields))})"
    if kind in _EXPECTED:
        return f"{key}: expected {_EXPECTED[kind]}, got {value!r}"
    if kind == "finite_number":
        return f"{key}: must be finite, got {value!r}"
    if kind == "literal_error" and info is not None:
        return f"{key}: must be one of {list(typing.get_args(info.annotation))}, got {value!r}"
    if kind in _BOUND_ERRORS and info is not None:
        return f"{key}: must be {bounds_text(info)}, got {_as_stored(value, info)!r}"
    return f"{key}: {err['msg']}, got {value!r}"


def _owner(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose field (or unknown key) is `loc[-1]`."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        info = model.model_fields.get(str(part))
        nested = _model_of(info.annotation) if info is not None else None
        if nested is None:
            return None
        model = nested
    return model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds: `VLLMConfig`, or the model of `LoRAConfig | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(models) == 1 and isinstance(models[0], type) and issubclass(models[0], BaseModel):
        return models[0]
    return None


def bounds_text(info: FieldInfo, with_null: bool = True) -> str:
    """`> 0`, `>= 1 or null`, `in (0, 1]`: the field's constraints in words ("" if none)."""
    low: tuple[str, str, Any] | None = None
    high: tuple[str, str, Any] | None = None
    for c in info.metadata:
        if isinstance(c, annotated_types.Gt):
            low = ("(", ">", c.gt)
        elif isinstance(c, annotated_types.Ge):
            low = ("[", ">=", c.ge)
        elif isinstance(c, annotated_types.Lt):
            high = (")", "<", c.lt)
        elif isinstance(c, annotated_types.Le):
            high = ("]", "<=", c.le)
    one = low or high
    if one is None:
        return ""
    if low and high:
        words = f"in {low[0]}{low[2]:g}, {high[2]:g}{high[0]}"
    else:
        words = f"{one[1]} {one[2]:g}"
    nullable = with_null and type(None) in _types(info.annotation)
    return f"{words} or null" if nullable else words


def _as_stored(value: Any, info: FieldInfo) -> Any:
    """An int given for a float field is reported as the float it is stored as (`got 0.0`)."""
    if float in _types(info.annotation) and type(value) is int:
        return float(value)
    return value


def _types(annotation: Any) -> set[Any]:
    """The plain types a field annotation admits: `Number | None` -> {float, NoneType}."""
    if typing.get_origin(annotation) is Annotated:
        return _types(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is Literal:
        return set()
    args = typing.get_args(annotation)
    if args:
        return set().union(*(_types(a) for a in args))
    return {annotation}
