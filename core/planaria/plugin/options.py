"""A plugin's options validated as planaria reads them from a config: every problem named
by where it is in the file, unknown keys with the keys the plugin takes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from planaria.errors import (
    ConfigIssue,
    PluginOptionsError,
)
from planaria.plugin.records import PluginRecord


def validate_options(record: PluginRecord, options: Any, *, path: str = "options") -> BaseModel:
    """``options`` validated by ``record``'s Options model, as planaria reads them from a
    config: a :class:`PluginOptionsError` (a :class:`~planaria.errors.ConfigError`) names every
    problem under ``path`` (``diagnosis.checks[0].options.max_temp: ...``)."""
    try:
        return record.options.model_validate(options)
    except ValidationError as exc:
        raise PluginOptionsError(
            [_option_issue(path, e, record.options) for e in exc.errors()]
        ) from None


def _option_issue(at: str, error: Any, model: type[BaseModel]) -> ConfigIssue:
    loc = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        message = f"unknown key; {model.__name__} takes: {', '.join(model.model_fields) or 'none'}"
    elif error["type"] == "missing":
        message = "required, but missing"
    else:
        message = str(error["msg"]).removeprefix("Value error, ")
    return ConfigIssue(f"{at}.{loc}" if loc else at, message)
