"""One typed error hierarchy: every error planaria raises on purpose is a ``PlanariaError``.

Messages say what is wrong, where, and what to do; the CLI prints them without a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PlanariaError(Exception):
    """Base of every error planaria raises on purpose."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration: where (a dotted path), what was found, what was expected."""

    path: str
    message: str
    line: int | None = None
    override: str | None = None
    """The ``--set PATH=VALUE`` that gave the value, when no line of the file did."""

    def __str__(self) -> str:
        where = self.path or "<top level>"
        if self.override is not None:
            where = f"{where} (--set {self.override})"
        elif self.line is not None:
            where = f"{where} (line {self.line})"
        return f"{where}: {self.message}"


class ConfigError(PlanariaError):
    """A configuration is invalid. Carries every problem found, not only the first."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        head = f"invalid configuration{f' in {source}' if source else ''}"
        count = len(self.issues)
        lines = [f"{head} ({count} problem{'s' if count != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class PluginError(PlanariaError):
    """A plugin could not be found, loaded or used."""


class PluginOptionsError(ConfigError, PluginError):
    """A plugin's options do not validate against its ``Options`` model: every problem, each
    under its config path (``checkpoint.storage.options.path``), as a config file's are."""


class PluginNotFoundError(PluginError):
    """A configured name matches no installed plugin record."""


class PluginLoadError(PluginError):
    """A plugin the configuration asks for failed to load (import error, bad hook ...)."""


class DuplicatePluginError(PluginError):
    """Two plugins register the same name for the same kind."""


class HealthCheckError(PlanariaError):
    """A health check could not run to a verdict (crashed, timed out, produced bad output).

    This is different from an unhealthy device: the check itself failed.
    """


class SchedulerError(PlanariaError):
    """The cluster manager refused or failed a request (launch, replace, stop)."""


class RendezvousError(PlanariaError):
    """Base of rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job is finishing, no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes joined before the join timeout."""


class StorageError(PlanariaError):
    """A checkpoint storage operation failed."""


class FencedError(StorageError):
    """A commit refused: its round was fenced out by the master (its node was declared lost)."""


class CheckpointCorruptError(StorageError):
    """A checkpoint failed verification (manifest, size or checksum) and must not be loaded."""


class CheckpointRestoreError(StorageError):
    """Committed checkpoints exist but none verifies, and the job asked to restore one
    (``checkpoint.require_restore``): training must not silently start from scratch."""
