"""The base of every config section and the number type they share (broker/config/config_sections.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, BaseModel, ConfigDict, Strict

# a finite float; an int is accepted and stored as a float
Number = Annotated[float, Strict(), AllowInfNan(False)]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignment is not re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)
