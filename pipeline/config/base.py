"""The bounded scalar types and the struct options every config section shares.

A section is a frozen, keyword-only msgspec Struct that forbids unknown fields, so a
misspelt key is an error naming its path, never a silently ignored setting."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Ratio = Annotated[float, Meta(gt=0, le=1)]
Probability = Annotated[float, Meta(gt=0, le=1)]


class ConfigError(ValueError):
    """A configuration is invalid; the message names the dotted path and the reason."""


def _section(**kw: Any) -> Any:
    return dict(kw, forbid_unknown_fields=True, kw_only=True, frozen=True)
