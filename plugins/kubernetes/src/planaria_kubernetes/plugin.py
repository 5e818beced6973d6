"""Registers the ``kubernetes`` scheduler through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import SchedulerRecord, hookimpl
from planaria_kubernetes.cli import commands
from planaria_kubernetes.options import KubernetesOptions
from planaria_kubernetes.scheduler import KubernetesScheduler


@hookimpl
def planaria_schedulers() -> Iterator[SchedulerRecord]:
    yield SchedulerRecord(
        name="kubernetes",
        factory=KubernetesScheduler,
        options=KubernetesOptions,
        commands=commands,
        summary="one pod per node, created and watched by the master; bad nodes avoided "
        "by node affinity",
    )
