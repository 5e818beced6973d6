"""Binds a validated config to its plugins: the health checks to run, the backends to build.

Sections the file spelled out were resolved during validation (:func:`.loader.validate`).
Sections left at their defaults are resolved here: a default health check must be installed,
a default scheduler or storage only matters to a command that uses it, so one that
is not installed is left out rather than reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from planaria.config.errors import Loc, format_path, issue_at, issues_from_validation
from planaria.config.loader import RawConfig, disabled_plugins, read, validate
from planaria.config.models import BackendSection, Config, backend_sections
from planaria.errors import ConfigError, ConfigIssue, PluginError
from planaria.health.api import HealthCheckRecord
from planaria.health.runner import ConfiguredCheck
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginRecord, normalize_name
from planaria.scheduler.api import Scheduler

# Backend sections outside diagnosis.checks (a list, resolved as the checks to run).
BACKEND_PATHS: tuple[tuple[str, ...], ...] = tuple(
    path for path, section in backend_sections() if path != ("diagnosis", "checks")
)


@dataclass(frozen=True)
class ResolvedBackend:
    """A backend section bound to its plugin record and validated options."""

    path: str
    record: PluginRecord
    options: BaseModel
    plugin: str = ""
    """The entry point that provides it: another process building the same backend loads
    that plugin alone (:meth:`~planaria.plugin.manager.PluginManager.for_spec`)."""


@dataclass(frozen=True)
class ResolvedConfig:
    config: Config
    checks: list[ConfiguredCheck]
    backends: dict[str, ResolvedBackend]
    """By dotted section path (``scheduler``, ``checkpoint.storage``); a section left at its
    default whose plugin is not installed is absent."""
    source: str | None = None
    lines: Mapping[Loc, int] = field(default_factory=dict)
    """The file's line of each value it spells out, for problems found after loading."""
    overrides: Mapping[Loc, str] = field(default_factory=dict)
    """The ``--set`` that gave each value it set."""

    def issue(self, path: str, message: str) -> ConfigIssue:
        """A problem at dotted ``path`` (``job.workdir``), with the line or ``--set`` it comes
        from."""
        loc = tuple(int(p) if p.isdigit() else p for p in path.split("."))
        return dataclasses.replace(issue_at(loc, message, self.lines, self.overrides), path=path)

    def dump(self) -> dict[str, Any]:
        """The whole configuration with every default filled in, options included.

        A default backend whose plugin is not installed is left out, so the dump reads back
        as the same configuration.
        """
        data: dict[str, Any] = self.config.model_dump(mode="json")
        for index, check in enumerate(self.checks):
            data["diagnosis"]["checks"][index]["options"] = check.options.model_dump(mode="json")
        for parts in BACKEND_PATHS:
            node = data
            for part in parts:
                node = node[part]
            backend = self.backends.get(".".join(parts))
            if backend is None:
                del node["backend"], node["options"]
            else:
                node["options"] = backend.options.model_dump(mode="json")
        if not data["checkpoint"]["storage"]:
            del data["checkpoint"]["storage"]
        return data


def _bind(
    section: BackendSection, manager: PluginManager, path: tuple[str | int, ...]
) -> tuple[PluginRecord, BaseModel]:
    """The record and options of a section, resolving it now if validation did not."""
    record = manager.resolve(section.kind, section.backend)
    if section.resolved:
        return record, section.options
    try:
        return record, record.options.model_validate(section.options)
    except ValidationError as exc:
        issues = issues_from_validation(exc, prefix=(*path, "options"), model=record.options)
        raise ConfigError(issues) from None


def resolve(config: Config, manager: PluginManager, source: str | None = None) -> ResolvedConfig:
    issues: list[ConfigIssue] = []
    checks: list[ConfiguredCheck] = []
    for index, check in enumerate(config.diagnosis.checks):
        path = ("diagnosis", "checks", index)
        try:
            record, options = _bind(check, manager, path)
        except PluginError as exc:
            issues.append(ConfigIssue(format_path((*path, "backend")), str(exc)))
            continue
        except ConfigError as exc:
            issues += exc.issues
            continue
        assert isinstance(record, HealthCheckRecord)
        checks.append(ConfiguredCheck(check.label, record, options, check.timeout))

    backends: dict[str, ResolvedBackend] = {}
    for parts in BACKEND_PATHS:
        node: Any = config
        for part in parts:
            node = getattr(node, part)
        section: BackendSection = node
        dotted = ".".join(parts)
        if not section.resolved and normalize_name(section.backend) not in manager.records(
            section.kind
        ):
            continue
        try:
            record, options = _bind(section, manager, parts)
        except PluginError as exc:
            issues.append(ConfigIssue(f"{dotted}.backend", str(exc)))
            continue
        except ConfigError as exc:
            issues += exc.issues
            continue
        plugin = manager.provider(section.kind, record.name).name.split("@")[0]
        backends[dotted] = ResolvedBackend(dotted, record, options, plugin)
    if issues:
        raise ConfigError(issues, source)
    return ResolvedConfig(config, checks, backends, source)


def load(
    path: str | Path | None,
    overrides: list[str] | None = None,
    manager: PluginManager | None = None,
) -> tuple[ResolvedConfig, PluginManager]:
    """Read, override, validate and resolve a config file (the defaults when ``path`` is None).

    Without ``manager``, plugins load from entry points, minus the file's ``plugins.disable``.
    """
    return load_raw(read(path, overrides), manager)


def load_raw(
    raw: RawConfig, manager: PluginManager | None = None, *, ask_cluster: bool = True
) -> tuple[ResolvedConfig, PluginManager]:
    """:func:`load` for a config already read (and overridden). Without ``ask_cluster``, a
    scheduler whose nodes are elsewhere is not asked whether it can give the job its nodes:
    that asks its cluster (a Slurm controller, a Ray or Kubernetes API), which a dry run or a
    check of the file alone must not need."""
    if manager is None:
        manager = PluginManager.from_entry_points(disable=disabled_plugins(raw))
    try:
        manager.check_duplicates()
    except PluginError as exc:
        raise ConfigError([ConfigIssue("plugins", str(exc))], raw.source) from None
    config = validate(raw, manager)
    resolved = dataclasses.replace(
        resolve(config, manager, raw.source), lines=raw.lines, overrides=raw.overrides
    )
    issues = capacity_issues(resolved, ask_cluster=ask_cluster)
    if issues:
        raise ConfigError(issues, raw.source)
    return resolved, manager


def capacity_issues(resolved: ResolvedConfig, *, ask_cluster: bool = True) -> list[ConfigIssue]:
    """What the job's scheduler says it cannot give a job of this size; without
    ``ask_cluster``, only a scheduler whose nodes are this machine is asked."""
    scheduler = resolved.backends.get("scheduler")
    if scheduler is None or not issubclass(scheduler.record.factory, Scheduler):
        return []
    if not ask_cluster and not scheduler.record.factory.nodes_here:
        return []
    job = resolved.config.job
    found = scheduler.record.factory.capacity_issues(
        scheduler.options, nodes=job.nodes.max + job.standby, procs_per_node=job.procs_per_node
    )
    return [resolved.issue(issue.path, issue.message) for issue in found]
