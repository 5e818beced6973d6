"""The plugin manager: loads entry points, collects records, resolves configured names.

Every plugin, built-in or third-party, arrives through the entry-point group ``planaria``.
A plugin that fails (import error, unknown hook, a hook that raises or returns garbage) is
recorded as ``failed`` with the reason and skipped with a warning, so one broken vendor package
never takes the others down; it becomes an error only when the configuration selects it.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel

from planaria import __version__, install
from planaria.errors import (
    ConfigIssue,
    DuplicatePluginError,
    PluginLoadError,
    PluginNotFoundError,
    PluginOptionsError,
)
from planaria.events import JobEvent
from planaria.fault_pattern.api import FaultPattern
from planaria.log import get_logger
from planaria.plugin import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from planaria.plugin.info import (
    DISABLE_ENV,
    PluginInfo,
    PluginStatus,
    disabled_from_env,
    one_line,
)
from planaria.plugin.kinds import RECORD_TYPES, well_known
from planaria.plugin.options import validate_options
from planaria.plugin.records import PluginKind, PluginRecord, normalize_name

__all__ = [
    "DISABLE_ENV",
    "PluginInfo",
    "PluginManager",
    "PluginStatus",
    "disabled_from_env",
    "validate_options",
]

log = get_logger("plugins")

ESSENTIAL: dict[str, str] = {"rendezvous": "planaria.rendezvous.builtin"}
"""Core plugins loaded with the entry points, not through them, and never blocked: every job's
master places ranks with one of them (``stable`` unless the file says otherwise), so a blocked
or missing one would stop every job. They register through the same hooks as any plugin."""


class PluginManager:
    """Owns the pluggy manager and everything known about each plugin.

    ``PluginManager.from_entry_points(disable=[...])`` is the usual way in; tests and embedding
    programs may also :meth:`register` plugin objects directly.
    """

    def __init__(self, disable: Iterable[str] = ()) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs.PlanariaSpecs)
        self._disabled = {normalize_name(n) for n in disable}
        self.plugins: dict[str, PluginInfo] = {}
        self._records: dict[PluginKind, dict[str, tuple[PluginRecord, PluginInfo]]] | None = None
        self._patterns: list[tuple[str, FaultPattern]] = []
        self._duplicates: list[str] = []

    @classmethod
    def from_entry_points(
        cls, disable: Iterable[str] = (), only: Iterable[str] | None = None
    ) -> PluginManager:
        """Every installed plugin but the disabled ones; with ``only``, just the entry points
        of those names (a worker building its one storage imports no other plugin)."""
        manager = cls([*disable, *disabled_from_env()])
        manager.load_entry_points(only)
        return manager

    @classmethod
    def for_spec(cls, spec: Mapping[str, Any], disable: Iterable[str] = ()) -> PluginManager:
        """The plugins a spec made by the master needs: its ``plugin`` (the entry point that
        provided the backend there) alone when it names one, else every installed plugin."""
        plugin = spec.get("plugin") if isinstance(spec, Mapping) else None
        return cls.from_entry_points(disable, only=[plugin] if isinstance(plugin, str) else None)

    def bind(
        self, kind: PluginKind, spec: Mapping[str, Any], *, path: str
    ) -> tuple[PluginRecord, BaseModel]:
        """The record ``spec`` selects (``{"backend": NAME, "options": {...}}``, the shape of
        every backend section of the config) and its validated options. An unknown name is a
        :class:`PluginNotFoundError` listing the installed choices; options that do not
        validate are a :class:`PluginOptionsError` naming each problem under ``path``
        (``checkpoint.storage.options.path: ...``)."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("backend"), str):
            raise PluginOptionsError(
                [ConfigIssue(path, f"expected {{backend: NAME, options: {{...}}}}, not {spec!r}")]
            )
        record = self.resolve(kind, spec["backend"])
        options = spec.get("options")
        if not isinstance(options, record.options):
            options = validate_options(record, options or {}, path=f"{path}.options")
        return record, options

    def build(
        self, kind: PluginKind, spec: Mapping[str, Any], *args: Any, path: str, **kwargs: Any
    ) -> Any:
        """An instance of the plugin ``spec`` selects: :meth:`bind`, then
        ``factory(options, *args, **kwargs)``. The one way a plugin instance is made from a
        spec, in the master, an agent, a persister, a restoring worker or a benchmark child."""
        record, options = self.bind(kind, spec, path=path)
        return record.factory(options, *args, **kwargs)

    # -- loading ---------------------------------------------------------------------------

    def _is_disabled(self, name: str, distribution: str | None) -> bool:
        names = {normalize_name(name)}
        if distribution:
            names.add(normalize_name(distribution))
        return bool(names & self._disabled)

    def load_entry_points(self, only: Iterable[str] | None = None) -> None:
        wanted = None if only is None else {normalize_name(n) for n in only}
        for name, module in ESSENTIAL.items():
            if (wanted is None or name in wanted) and name not in self.plugins:
                info = PluginInfo(name, module, distribution="planaria", version=__version__)
                self.plugins[name] = info
                self._register(importlib.import_module(module), info)
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if wanted is None or normalize_name(ep.name) in wanted:
                self._load_entry_point(ep)

    def _load_entry_point(self, ep: EntryPoint) -> None:
        dist = ep.dist
        info = PluginInfo(
            name=self._unique_name(ep.name, dist.name if dist else None),
            value=ep.value,
            distribution=dist.name if dist else None,
            version=dist.version if dist else None,
        )
        self.plugins[info.name] = info
        if self._is_disabled(ep.name, info.distribution):
            info.status = PluginStatus.BLOCKED
            info.reason = f"disabled by plugins.disable or {DISABLE_ENV}"
            return
        try:
            obj = ep.load()
        except Exception as exc:
            self._fail(info, f"import of {ep.value!r} failed: {one_line(exc)}")
            return
        self._register(obj, info)

    def _unique_name(self, name: str, distribution: str | None) -> str:
        if name not in self.plugins:
            return name
        return f"{name}@{distribution}"

    def register(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginInfo:
        """Register a plugin object (a module or an instance with ``@hookimpl`` methods)."""
        info = PluginInfo(
            name=self._unique_name(name, distribution),
            value=repr(plugin),
            distribution=distribution,
            version=version,
        )
        self.plugins[info.name] = info
        if self._is_disabled(name, distribution):
            info.status = PluginStatus.BLOCKED
            info.reason = f"disabled by plugins.disable or {DISABLE_ENV}"
            return info
        self._register(plugin, info)
        return info

    def _register(self, obj: object, info: PluginInfo) -> None:
        self._records = None
        try:
            self._pm.register(obj, name=info.name)
        except Exception as exc:  # pluggy's PluginValidationError, or a name clash
            self._fail(info, one_line(exc))
            return
        unknown = [hc.name for hc in self._pm.get_hookcallers(obj) or [] if not hc.has_spec()]
        if unknown:
            self._pm.unregister(obj)
            known = [n for n in dir(hookspecs.PlanariaSpecs) if n.startswith("planaria_")]
            hints = []
            for hook in unknown:
                close = difflib.get_close_matches(hook, known, n=1)
                hints.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            self._fail(info, f"unknown hook {', '.join(hints)}; known hooks: {', '.join(known)}")

    def _fail(self, info: PluginInfo, reason: str) -> None:
        info.status = PluginStatus.FAILED
        info.reason = reason
        info.records = []
        info.fault_patterns = []
        obj = self._pm.get_plugin(info.name)
        if obj is not None:
            self._pm.unregister(obj)
        log.warning(
            "plugin failed to load and is skipped",
            plugin=info.name,
            distribution=info.distribution,
            reason=reason,
        )

    # -- records ---------------------------------------------------------------------------

    def _collect(self) -> dict[PluginKind, dict[str, tuple[PluginRecord, PluginInfo]]]:
        if self._records is not None:
            return self._records
        per_plugin: dict[str, list[PluginRecord]] = {}
        patterns: dict[str, list[FaultPattern]] = {}
        for kind in PluginKind:
            caller = getattr(self._pm.hook, kind.hook)
            for impl in caller.get_hookimpls():
                info = self.plugins[impl.plugin_name]
                if info.status is not PluginStatus.LOADED:
                    continue
                try:
                    produced = self._call_registration(impl.function, kind)
                except Exception as exc:
                    self._fail(info, f"{kind.hook}() failed: {one_line(exc)}")
                    per_plugin.pop(info.name, None)
                    patterns.pop(info.name, None)
                    continue
                for record in produced:
                    if isinstance(record, FaultPattern):
                        patterns.setdefault(info.name, []).append(record)
                    else:
                        per_plugin.setdefault(info.name, []).append(record)

        collected: dict[PluginKind, dict[str, tuple[PluginRecord, PluginInfo]]] = {
            k: {} for k in PluginKind
        }
        duplicates: list[str] = []
        for plugin_name, records in per_plugin.items():
            info = self.plugins[plugin_name]
            if info.status is not PluginStatus.LOADED:
                continue
            info.records = records
            for record in records:
                seen = collected[record.kind].get(record.name)
                if seen is not None:
                    duplicates.append(
                        f"{record.kind.label} {record.name!r} is registered by both "
                        f"{seen[1].provider} (plugin {seen[1].name!r}) and "
                        f"{info.provider} (plugin {info.name!r}); uninstall one, or disable "
                        "one in plugins.disable"
                    )
                    continue
                collected[record.kind][record.name] = (record, info)
        self._patterns = []
        for plugin_name, found in patterns.items():
            info = self.plugins[plugin_name]
            if info.status is PluginStatus.LOADED:
                info.fault_patterns = found
                self._patterns += [(plugin_name, pattern) for pattern in found]
        self._duplicates = duplicates
        self._records = collected
        return collected

    @staticmethod
    def _call_registration(function: Any, kind: PluginKind) -> list[PluginRecord | FaultPattern]:
        expected = RECORD_TYPES[kind]
        result = function()
        if result is None:
            return []
        # One record alone; iterating a pydantic model would yield its fields instead.
        if isinstance(result, BaseModel):
            result = [result]
        records = list(result)
        for record in records:
            if not isinstance(record, expected):
                raise TypeError(
                    f"{kind.hook}() must return {expected.__name__} records, "
                    f"got {type(record).__name__}"
                )
        return records

    def check_duplicates(self) -> None:
        """Raise :class:`DuplicatePluginError` if two plugins claim one name of one kind."""
        self._collect()
        if self._duplicates:
            raise DuplicatePluginError("\n".join(self._duplicates))

    def records(self, kind: PluginKind) -> dict[str, PluginRecord]:
        """Every record of ``kind`` by name. Raises on duplicate names."""
        self.check_duplicates()
        return {name: rec for name, (rec, _) in sorted(self._collect()[kind].items())}

    def provider(self, kind: PluginKind, name: str) -> PluginInfo:
        return self._collect()[kind][normalize_name(name)][1]

    def resolve(self, kind: PluginKind, name: str) -> PluginRecord:
        """The record registered as ``name``, or an error that says what to do instead."""
        available = self.records(kind)
        key = normalize_name(name)
        if key in available:
            return available[key]
        package = well_known(kind).get(key)
        for info in self.plugins.values():
            claims = normalize_name(info.name.split("@")[0]) == key or (
                package is not None
                and info.distribution is not None
                and normalize_name(info.distribution) == normalize_name(package)
            )
            if not claims:
                continue
            if info.status is PluginStatus.BLOCKED:
                raise PluginLoadError(
                    f"{kind.label} {name!r} is provided by {info.provider}, which is disabled "
                    f"(plugins.disable or {DISABLE_ENV}); remove it from there to use it"
                )
            if info.status is PluginStatus.FAILED:
                raise PluginLoadError(
                    f"{kind.label} {name!r} is provided by {info.provider}, which failed to "
                    f"load: {info.reason}"
                )
        choices = ", ".join(available) or "(none installed)"
        message = f"{kind.label} {name!r} is not installed. Choose one of: {choices}"
        if package is not None:
            message += f"; or install it: {install.hint(package)}"
        # A plugin that did not load may be the one that provides the name.
        failed = [i for i in self.plugins.values() if i.status is PluginStatus.FAILED]
        if failed:
            message += "; plugins that failed to load: " + ", ".join(
                f"{i.name} ({i.reason})" for i in failed
            )
        blocked = [i for i in self.plugins.values() if i.status is PluginStatus.BLOCKED]
        if blocked:
            message += (
                "; plugins disabled by plugins.disable or "
                + DISABLE_ENV
                + ": "
                + ", ".join(f"{i.name} ({i.provider})" for i in blocked)
            )
        raise PluginNotFoundError(message)

    def fault_patterns(self) -> list[tuple[str, FaultPattern]]:
        """Every ``planaria_fault_patterns`` record with its plugin's name, in the order the
        classifier tries them. A plugin whose hook fails is ``failed``, like for any kind."""
        self._collect()
        return list(self._patterns)

    # -- lifecycle hooks -------------------------------------------------------------------

    def emit(self, event: JobEvent) -> None:
        """Deliver ``event`` to every ``planaria_job_event`` implementation, each isolated."""
        for impl in self._pm.hook.planaria_job_event.get_hookimpls():
            try:
                # pluggy lets an implementation take fewer arguments than the spec offers.
                impl.function(**{arg: event for arg in impl.argnames})
            except Exception as exc:
                log.warning(
                    "job event observer failed",
                    plugin=impl.plugin_name,
                    event_kind=event.kind.value,
                    error=one_line(exc),
                )
