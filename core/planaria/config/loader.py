"""Reads a config file (YAML or TOML), applies ``--set`` overrides and validates every section.

All problems are collected and raised together as one :class:`ConfigError`, each with the path
and where its value comes from: for YAML, its line; for an override, the ``--set`` that gave it.
Unquoted values are read as YAML 1.2 reads them (:mod:`planaria.config.scalars`): ``nodes: 4:8``
is the range 4 to 8, not YAML 1.1's base-60 number 248.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import BaseModel, ValidationError

from planaria.config.errors import Loc, format_path, issues_from_validation
from planaria.config.models import Config, backend_sections
from planaria.config.scalars import Yaml12Resolver
from planaria.errors import ConfigError, ConfigIssue, PlanariaError
from planaria.plugin.manager import PluginManager

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
        self.overrides: dict[Loc, str] = {}
        """The ``--set PATH=VALUE`` that gave the value at each path it set (the file's line
        of that path, and of every path below it, is dropped)."""


MAX_ALIAS_VALUES = 10_000
"""The most values YAML aliases may add to a file. A config file reuses a few sections; an
alias bomb ("billion laughs": ``b: &b [*a, *a, ...]`` nested a few times) makes a few hundred
bytes expand into billions of values."""
MAX_DEPTH = 64
"""The deepest nesting a config file may have (a real one has fewer than ten levels)."""


class _StrictLoader(Yaml12Resolver, yaml.SafeLoader):
    """Safe YAML, its unquoted values read as YAML 1.2 reads them, that rejects a key given
    twice in one mapping (PyYAML keeps the last), an alias inside the value it names, nesting
    deeper than :data:`MAX_DEPTH`, and aliases that expand the file by more than
    :data:`MAX_ALIAS_VALUES` values.

    PyYAML composes an alias as a reference to the anchored node, so a bomb is small in memory
    until something walks its values (the line map, validation) and meets every copy: the
    expansion is counted while composing, in time proportional to the file."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._path: list[str | int] = []
        self._open: list[str | None] = []  # anchors of the collections being composed
        self._sizes: dict[int, int] = {}
        self._added = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        pushed = parent is not None and index is not None
        if pushed:  # a mapping's value (index: its key node) or a sequence's item
            part = index.value if isinstance(index, yaml.Node) else index
            self._path.append(part if isinstance(part, (str, int)) else "?")
        event = self.peek_event()  # type: ignore[no-untyped-call]
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection:
            self._open.append(event.anchor)
        try:
            if isinstance(event, yaml.AliasEvent):
                self._count_alias(event)
            elif len(self._open) > MAX_DEPTH:
                self._refuse(event, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            if collection:
                self._open.pop()
            if pushed:
                self._path.pop()

    def _count_alias(self, event: yaml.AliasEvent) -> None:
        if event.anchor in self._open:
            self._refuse(
                event,
                f"the alias *{event.anchor} is inside the value it names, which would never "
                "end; write the value out instead",
            )
        target = self.anchors.get(event.anchor)
        if target is None:
            return  # undefined: PyYAML says so
        self._added += self._size(target)
        if self._added > MAX_ALIAS_VALUES:
            self._refuse(
                event,
                f"YAML aliases (here *{event.anchor}) expand the file by more than "
                f"{MAX_ALIAS_VALUES} values, as an alias bomb does; a config file needs far "
                "fewer: write the values out, or alias smaller pieces",
            )

    def _size(self, node: yaml.Node) -> int:
        """How many values ``node`` stands for, its aliases expanded; each node is counted
        once, so this takes as long as the file, not as its expansion."""
        known = self._sizes.get(id(node))
        if known is not None:
            return known
        size = 1
        if isinstance(node, yaml.SequenceNode):
            size += sum(self._size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            size += sum(self._size(k) + self._size(v) for k, v in node.value)
        self._sizes[id(node)] = size
        return size

    def _refuse(self, event: yaml.Event, message: str) -> NoReturn:
        line = None if event.start_mark is None else event.start_mark.line + 1
        raise ConfigError([ConfigIssue(format_path(self._path), message, line)])

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as exc:  # a scalar that looks like a type it is not: 2024-13-45
            value = node.value if isinstance(node, yaml.ScalarNode) else ""
            shown = value if len(value) <= 40 else value[:37] + "..."
            reason = str(exc).split("; use sys.set_int_max_str_digits")[0]  # not for a file
            message = f"cannot read {shown!r}: {reason}"
            raise ConfigError([ConfigIssue("", message, node.start_mark.line + 1)]) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *base``: its keys may be given again, that is its point
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):  # ``{}: 1``, ``? [a, b]``: no config has such a key
                kind = "a mapping" if isinstance(key, dict) else "a list"
                message = f"a key must be a name, not {kind}"
                raise ConfigError([ConfigIssue(format_path(self._path), message, line)])
            if key in seen:
                raise ConfigError(
                    [ConfigIssue(str(key), f"key given twice (lines {seen[key]} and {line})", line)]
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> tuple[Any, dict[Loc, int]]:
    """The data of a YAML document and the line of each value, composed once."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        _line_map(node, (), lines)  # before construction, which rewrites merge keys (<<)
        return (None if node is None else loader.construct_document(node)), lines
    finally:
        loader.dispose()


def _line_map(node: yaml.Node | None, loc: Loc, lines: dict[Loc, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # a mapping or a list as a key: construction refuses it, with its line
            child = (*loc, key_node.value)
            lines[child] = key_node.start_mark.line + 1
            _line_map(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*loc, index)
            lines[child] = item.start_mark.line + 1
            _line_map(item, child, lines)


def parse_text(text: str, source: str, *, toml: bool = False) -> RawConfig:
    if toml:
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([ConfigIssue("", f"not valid TOML: {exc}")], source) from None
        except RecursionError:
            raise ConfigError(
                [ConfigIssue("", "nested too deeply for a config file")], source
            ) from None
        lines: dict[Loc, int] = {}
    else:
        try:
            data, lines = _load_yaml(text)
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
            value = _load_yaml(text)[0] if text.strip() else ""
        except (ValueError, yaml.YAMLError) as exc:
            issues.append(ConfigIssue(f"--set {item}", str(exc)))
            continue
        except ConfigError as exc:
            issues += [ConfigIssue(f"--set {item}", issue.message) for issue in exc.issues]
            continue
        try:
            _set(raw.data, parts, value)
        except (KeyError, IndexError, TypeError) as exc:
            issues.append(ConfigIssue(f"--set {item}", str(exc.args[0] if exc.args else exc)))
            continue
        _record_override(raw, tuple(parts), item)
    if issues:
        raise ConfigError(issues, raw.source)


def _record_override(raw: RawConfig, at: Loc, item: str) -> None:
    """The value at ``at``, and all below it, now comes from ``--set item``, not the file."""

    def below(loc: Loc) -> bool:
        return loc[: len(at)] == at

    raw.lines = {loc: line for loc, line in raw.lines.items() if not below(loc)}
    raw.overrides = {loc: text for loc, text in raw.overrides.items() if not below(loc)}
    raw.overrides[at] = item


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
        issues = issues_from_validation(
            exc, model=Config, lines=raw.lines, overrides=raw.overrides, fallback=options_model
        )
        raise ConfigError(issues, raw.source) from None


_KIND_AT = {path: section.kind for path, section in backend_sections()}


def read(path: str | Path | None, overrides: list[str] | None = None) -> RawConfig:
    """Read a config file (or start from the defaults, when ``path`` is None) and apply
    ``--set`` overrides."""
    raw = read_file(path) if path is not None else RawConfig({}, source="<defaults>")
    if overrides:
        apply_overrides(raw, overrides)
    return raw
