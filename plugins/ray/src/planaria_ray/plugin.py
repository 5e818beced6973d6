"""Registers the ``ray`` scheduler through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import SchedulerRecord, hookimpl
from planaria_ray.options import RayOptions
from planaria_ray.scheduler import RayScheduler


@hookimpl
def planaria_schedulers() -> Iterator[SchedulerRecord]:
    yield SchedulerRecord(
        name="ray",
        factory=RayScheduler,
        options=RayOptions,
        summary="one agent per Ray node as an actor; strict spread, bad nodes excluded by id",
    )
