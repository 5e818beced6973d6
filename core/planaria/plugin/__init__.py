"""What a plugin author imports: the hook markers, every kind's interface and record type.

::

    from planaria.plugin import HealthCheck, HealthCheckRecord, DeviceResult, Status, hookimpl

Each name lives in its kind's ``api`` module (``planaria.health.api``, ``planaria.scheduler.api``
and the engine a scheduler runs on, ``planaria.scheduler.engine``,
``planaria.storage.api``, ``planaria.node_benchmark.api``, ``planaria.fault_pattern.api``,
``planaria.rendezvous.api``; the
errors a plugin raises, and the ``ConfigError`` its bad options are, from ``planaria.errors``);
this module hands them out on first use, so that importing the markers loads no kind at all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

PROJECT_NAME = "planaria"
ENTRY_POINT_GROUP = "planaria"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

_HOME = {
    "planaria.plugin.records": ("NoOptions", "PluginKind", "PluginRecord", "normalize_name"),
    "planaria.health.api": (
        "CheckContext",
        "CheckResult",
        "DeviceResult",
        "HealthCheck",
        "HealthCheckRecord",
        "Status",
    ),
    "planaria.scheduler.api": (
        "LaunchSpec",
        "NodeEvent",
        "NodeHandle",
        "NodeState",
        "Scheduler",
        "SchedulerRecord",
        "SubmitRequest",
        "SubmitResult",
        "poll_events",
    ),
    "planaria.scheduler.engine": ("EngineNode", "EngineScheduler", "Unplaceable", "exit_event"),
    "planaria.storage.api": ("CheckpointStorage", "CheckpointStorageRecord", "split_key"),
    "planaria.node_benchmark.api": (
        "BenchmarkContext",
        "BenchmarkResult",
        "NodeBenchmark",
        "NodeBenchmarkRecord",
    ),
    "planaria.fault_pattern.api": (
        "Classification",
        "FaultClass",
        "FaultKind",
        "FaultPattern",
        "match",
    ),
    "planaria.rendezvous.api": ("Candidate", "RankPlacement", "RendezvousRecord"),
    "planaria.events": ("EventKind", "JobEvent"),
    "planaria.errors": (
        "ConfigError",
        "ConfigIssue",
        "HealthCheckError",
        "PlanariaError",
        "SchedulerError",
        "StorageError",
    ),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "BenchmarkContext",
    "BenchmarkResult",
    "Candidate",
    "CheckContext",
    "CheckResult",
    "CheckpointStorage",
    "CheckpointStorageRecord",
    "Classification",
    "ConfigError",
    "ConfigIssue",
    "DeviceResult",
    "EngineNode",
    "EngineScheduler",
    "EventKind",
    "FaultClass",
    "FaultKind",
    "FaultPattern",
    "HealthCheck",
    "HealthCheckError",
    "HealthCheckRecord",
    "JobEvent",
    "LaunchSpec",
    "NoOptions",
    "NodeBenchmark",
    "NodeBenchmarkRecord",
    "NodeEvent",
    "NodeHandle",
    "NodeState",
    "PlanariaError",
    "PluginKind",
    "PluginRecord",
    "RankPlacement",
    "RendezvousRecord",
    "Scheduler",
    "SchedulerError",
    "SchedulerRecord",
    "Status",
    "StorageError",
    "SubmitRequest",
    "SubmitResult",
    "Unplaceable",
    "exit_event",
    "hookimpl",
    "hookspec",
    "match",
    "normalize_name",
    "poll_events",
    "split_key",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'planaria.plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from planaria.errors import (
        ConfigError,
        ConfigIssue,
        HealthCheckError,
        PlanariaError,
        SchedulerError,
        StorageError,
    )
    from planaria.events import EventKind, JobEvent
    from planaria.fault_pattern.api import (
        Classification,
        FaultClass,
        FaultKind,
        FaultPattern,
        match,
    )
    from planaria.health.api import (
        CheckContext,
        CheckResult,
        DeviceResult,
        HealthCheck,
        HealthCheckRecord,
        Status,
    )
    from planaria.node_benchmark.api import (
        BenchmarkContext,
        BenchmarkResult,
        NodeBenchmark,
        NodeBenchmarkRecord,
    )
    from planaria.plugin.records import NoOptions, PluginKind, PluginRecord, normalize_name
    from planaria.rendezvous.api import Candidate, RankPlacement, RendezvousRecord
    from planaria.scheduler.api import (
        LaunchSpec,
        NodeEvent,
        NodeHandle,
        NodeState,
        Scheduler,
        SchedulerRecord,
        SubmitRequest,
        SubmitResult,
        poll_events,
    )
    from planaria.scheduler.engine import EngineNode, EngineScheduler, Unplaceable, exit_event
    from planaria.storage.api import CheckpointStorage, CheckpointStorageRecord, split_key
