"""Turns pydantic's validation errors into :class:`ConfigIssue` lines a person can act on:
the path as written in the file (``diagnosis.checks[1].options.timeout``), its line (or the
``--set`` that gave it), the bad value
and what was expected; for an unknown key, the keys that are allowed and the likely intended one.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from pydantic import BaseModel, ValidationError

from planaria.errors import ConfigIssue

Loc = tuple[str | int, ...]


def format_path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def line_of(loc: Loc, lines: Mapping[Loc, int] | None) -> int | None:
    """The line of the longest prefix of ``loc`` that the file spells out."""
    return origin(loc, lines)[0]


def origin(
    loc: Loc, lines: Mapping[Loc, int] | None, overrides: Mapping[Loc, str] | None = None
) -> tuple[int | None, str | None]:
    """Where the value at ``loc`` comes from: (the file's line, None) or (None, the
    ``--set`` that gave it), whichever spells out the longest prefix of ``loc``."""
    for end in range(len(loc), 0, -1):
        prefix = tuple(loc[:end])
        if overrides and prefix in overrides:
            return None, overrides[prefix]
        if lines and prefix in lines:
            return lines[prefix], None
    return None, None


def issue_at(
    loc: Loc,
    message: str,
    lines: Mapping[Loc, int] | None,
    overrides: Mapping[Loc, str] | None = None,
) -> ConfigIssue:
    """A problem at ``loc``, located in the file or on the command line."""
    line, override = origin(loc, lines, overrides)
    return ConfigIssue(format_path(loc), message, line, override)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unwrap(annotation: Any) -> Any:
    """``list[CheckSection] | None`` -> ``CheckSection``: the model a path descends into."""
    while True:
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if (
            origin in (list, tuple, Sequence, Union, types.UnionType) and args
        ) or origin is typing.Annotated:
            annotation = args[0]
        else:
            return annotation


def model_at(model: type[BaseModel] | None, loc: Sequence[str | int]) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _unwrap(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


def unknown_key_message(key: str | int, allowed: Sequence[str]) -> str:
    message = f"unknown key {key!r}"
    if isinstance(key, str):
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    if allowed:
        message += f"; allowed here: {', '.join(allowed)}"
    return message


def issues_from_validation(
    exc: ValidationError,
    *,
    prefix: Loc = (),
    model: type[BaseModel] | None = None,
    lines: Mapping[Loc, int] | None = None,
    overrides: Mapping[Loc, str] | None = None,
    fallback: Callable[[Loc], type[BaseModel] | None] | None = None,
) -> list[ConfigIssue]:
    """One issue per pydantic error, located under ``prefix``; ``model`` is the model that
    was validated (to list the allowed keys when one is unknown), ``fallback`` finds the
    model below a loosely typed field (a plugin's ``options``)."""
    issues = []
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(p for p in err["loc"] if isinstance(p, (str, int)))
        kind = err["type"]
        if kind == "missing":
            message = "required, but missing"
        elif kind == "extra_forbidden":
            parent = model_at(model, loc[:-1])
            if parent is None and fallback is not None and "options" in loc:
                cut = len(loc) - 1 - loc[::-1].index("options")
                parent = model_at(fallback(loc), loc[cut + 1 : -1])
            allowed = list(parent.model_fields) if parent is not None else []
            message = unknown_key_message(loc[-1] if loc else "?", allowed)
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            if "input" in err and kind not in ("value_error", "assertion_error"):
                message += f" (got {_short(err['input'])})"
        issues.append(issue_at(prefix + loc, message, lines, overrides))
    return issues
