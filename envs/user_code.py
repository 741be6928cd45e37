"""Loading a function the user names as 'package.module:function' (reward functions, agents)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_function(spec: str, where: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable `spec` names; `error` with one line naming `where` (the config key) if its
    module cannot be imported, lacks the attribute, or the attribute is not callable."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # any failure while importing user code is a load error
        first = (str(e).splitlines() or [""])[0]
        raise error(f"{where}: cannot import {spec} ({type(e).__name__}: {first})") from None
    if not callable(fn):
        raise error(f"{where}: {spec} is not callable")
    return fn
