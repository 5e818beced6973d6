"""Reads a config file (YAML or TOML), applies ``--set`` overrides and validates every section.

All problems are collected and raised together as one :class:`ConfigError`, each with the path
and, for YAML, the line it comes from.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from planaria.config.errors import Loc, format_path, issues_from_validation
from planaria.config.models import Config
from planaria.errors import ConfigError, ConfigIssue, PlanariaError
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class RawConfig:
    """A parsed but unvalidated config: the data, where each key sits, and where it came from."""

    def __init__(
        self, data: dict[str, Any], lines: dict[Loc, int] | None = None, source: str | None = None
    ) -> None:
        self.data = data
        self.lines = lines or {}
        self.source = source


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that rejects a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    [ConfigIssue(str(key), f"key given twice (lines {seen[key]} and {line})", line)]
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _line_map(node: yaml.Node | None, loc: Loc = ()) -> dict[Loc, int]:
    lines: dict[Loc, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*loc, key_node.value)
            lines[child] = key_node.start_mark.line + 1
            lines.update(_line_map(value_node, child))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*loc, index)
            lines[child] = item.start_mark.line + 1
            lines.update(_line_map(item, child))
    return lines


def parse_text(text: str, source: str, *, toml: bool = False) -> RawConfig:
    if toml:
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([ConfigIssue("", f"not valid TOML: {exc}")], source) from None
        lines: dict[Loc, int] = {}
    else:
        try:
            data = yaml.load(text, Loader=_StrictLoader)
            lines = _line_map(yaml.compose(text, Loader=yaml.SafeLoader))
        except ConfigError as exc:
            raise ConfigError(exc.issues, source) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark is not None else None
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(
                [ConfigIssue("", f"not valid YAML: {problem}", line)], source
            ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                ConfigIssue(
                    "", f"the file must hold a mapping of sections, got {type(data).__name__}"
                )
            ],
            source,
        )
    return RawConfig(data, lines, source)


def read_file(path: str | Path) -> RawConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("", f"cannot read the file: {exc}")], str(path)) from None
    return parse_text(text, str(path), toml=path.suffix.lower() == ".toml")


_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parse_override_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    pos = 0
    for match in _SEGMENT.finditer(path):
        between = path[pos : match.start()]
        if between not in ("", "."):
            break
        parts.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        pos = match.end()
    if not parts or pos != len(path):
        raise ValueError(f"cannot parse the path {path!r}: expected keys such as a.b[0].c")
    return parts


def apply_overrides(raw: RawConfig, overrides: list[str]) -> None:
    """Apply ``--set a.b[0].c=VALUE`` overrides; ``VALUE`` is read as a YAML scalar or list."""
    issues = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            issues.append(ConfigIssue(f"--set {item}", "expected PATH=VALUE, e.g. job.nodes=2"))
            continue
        try:
            parts = _parse_override_path(key.strip())
            value = yaml.safe_load(text) if text.strip() else ""
        except (ValueError, yaml.YAMLError) as exc:
            issues.append(ConfigIssue(f"--set {item}", str(exc)))
            continue
        try:
            _set(raw.data, parts, value)
        except (KeyError, IndexError, TypeError) as exc:
            issues.append(ConfigIssue(f"--set {item}", str(exc.args[0] if exc.args else exc)))
    if issues:
        raise ConfigError(issues, raw.source)


def _set(data: Any, parts: list[str | int], value: Any) -> None:
    node = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = format_path(parts[: depth + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise TypeError(f"{format_path(parts[:depth])} is not a list")
            if part >= len(node):
                raise IndexError(f"{where}: the list has only {len(node)} item(s)")
            if last:
                node[part] = value
            else:
                node = node[part]
            continue
        if not isinstance(node, dict):
            raise TypeError(f"{format_path(parts[:depth])} is not a mapping")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                # A list index below a missing key cannot be created; a mapping can.
                if isinstance(parts[depth + 1], int):
                    raise KeyError(f"{where} is not set, so it has no items")
                node[part] = {}
            node = node[part]


def disabled_plugins(raw: RawConfig) -> list[str]:
    """``plugins.disable`` read before validation: it decides which plugins load, and the
    plugins are needed to validate the rest. A malformed value is reported by validation."""
    section = raw.data.get("plugins")
    names = section.get("disable") if isinstance(section, dict) else None
    if isinstance(names, list):
        return [n for n in names if isinstance(n, str)]
    return []


def validate(raw: RawConfig, manager: PluginManager | None = None) -> Config:
    """Validate the whole file in one pass; with ``manager``, plugin options too."""

    def options_model(loc: Loc) -> type[BaseModel] | None:
        # Unknown keys under ``options`` are listed against the selected plugin's model.
        if manager is None or "options" not in loc:
            return None
        cut = len(loc) - 1 - loc[::-1].index("options")
        node: Any = raw.data
        for part in loc[:cut]:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return None
        kind = _KIND_AT.get(tuple(p for p in loc[:cut] if isinstance(p, str)))
        if kind is None or not isinstance(node, dict):
            return None
        try:
            return manager.resolve(kind, str(node.get("backend"))).options
        except PlanariaError:
            return None

    try:
        return Config.model_validate(raw.data, context={"plugins": manager} if manager else None)
    except ValidationError as exc:
        issues = issues_from_validation(exc, model=Config, lines=raw.lines, fallback=options_model)
        raise ConfigError(issues, raw.source) from None


_KIND_AT = {
    ("scheduler",): PluginKind.SCHEDULER,
    ("rendezvous",): PluginKind.RENDEZVOUS_BACKEND,
    ("checkpoint", "storage"): PluginKind.CHECKPOINT_STORAGE,
    ("diagnosis", "checks"): PluginKind.HEALTH_CHECK,
    ("diagnosis", "preflight_benchmark"): PluginKind.NODE_BENCHMARK,
}


def read(path: str | Path | None, overrides: list[str] | None = None) -> RawConfig:
    """Read a config file (or start from the defaults, when ``path`` is None) and apply
    ``--set`` overrides."""
    raw = read_file(path) if path is not None else RawConfig({}, source="<defaults>")
    if overrides:
        apply_overrides(raw, overrides)
    return raw
