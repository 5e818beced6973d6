"""Every plugin kind and its record type: the one place a new kind is added (with its
``planaria.<kind>.api`` module and its hook in :mod:`planaria.plugin.hookspecs`)."""

from __future__ import annotations

from planaria.fault_pattern.api import FaultPattern
from planaria.health.api import HealthCheckRecord
from planaria.node_benchmark.api import NodeBenchmarkRecord
from planaria.plugin.records import PluginKind, PluginRecord
from planaria.rendezvous.api import RendezvousRecord
from planaria.scheduler.api import SchedulerRecord
from planaria.storage.api import CheckpointStorageRecord

RECORD_TYPES: dict[PluginKind, type[PluginRecord] | type[FaultPattern]] = {
    PluginKind.HEALTH_CHECK: HealthCheckRecord,
    PluginKind.SCHEDULER: SchedulerRecord,
    PluginKind.CHECKPOINT_STORAGE: CheckpointStorageRecord,
    PluginKind.NODE_BENCHMARK: NodeBenchmarkRecord,
    PluginKind.FAULT_PATTERN: FaultPattern,
    PluginKind.RENDEZVOUS: RendezvousRecord,
}
if set(RECORD_TYPES) != set(PluginKind):  # pragma: no cover - caught by any test run
    raise RuntimeError("every PluginKind needs its record type in planaria.plugin.kinds")


def well_known(kind: PluginKind) -> dict[str, str]:
    """Names of ``kind`` whose distribution is known: ``{"nvidia": "planaria-nvidia"}``."""
    record = RECORD_TYPES[kind]
    return record.well_known if issubclass(record, PluginRecord) else {}
