"""Registers the ``slurm`` scheduler through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import SchedulerRecord, hookimpl
from planaria_slurm.options import SlurmOptions
from planaria_slurm.scheduler import SlurmScheduler


@hookimpl
def planaria_schedulers() -> Iterator[SchedulerRecord]:
    yield SchedulerRecord(
        name="slurm",
        factory=SlurmScheduler,
        options=SlurmOptions,
        summary="one agent per node as a step of a Slurm allocation; spares, exclusion, sbatch",
    )
