"""Registers the ``custom_script`` health check through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import HealthCheckRecord, hookimpl
from planaria_custom_script.check import CustomScriptCheck
from planaria_custom_script.options import CustomScriptOptions


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="custom_script",
        factory=CustomScriptCheck,
        options=CustomScriptOptions,
        summary="any chip: runs a user executable speaking a JSON-lines protocol",
    )
