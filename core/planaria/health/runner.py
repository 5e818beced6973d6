"""Runs configured health checks, each isolated in its own thread with its own timeout.

One check that raises, hangs or returns garbage is reported as ``error`` and never hides the
others. Checks run concurrently, so a node's verdict takes as long as its slowest check.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from planaria.errors import HealthCheckError
from planaria.health.api import (
    CheckContext,
    CheckResult,
    DeviceResult,
    HealthCheck,
    HealthCheckRecord,
    NodeHealth,
    Status,
)
from planaria.log import get_logger

log = get_logger("checks")


@dataclass(frozen=True)
class ConfiguredCheck:
    """A health check as the config selected it: its record, validated options and timeout."""

    name: str
    record: HealthCheckRecord
    options: BaseModel
    timeout: float


class _Run:
    """One check in its own daemon thread. The first verdict wins: a check that finishes after
    its timeout was reported never changes what was reported."""

    def __init__(self, check: ConfiguredCheck, context: CheckContext) -> None:
        self.check = check
        self.context = context
        self._lock = threading.Lock()
        self._instance: HealthCheck[BaseModel] | None = None
        self._result: CheckResult | None = None
        self.started = time.monotonic()
        self.thread = threading.Thread(
            target=self._target, name=f"planaria-check-{check.name}", daemon=True
        )

    @property
    def deadline(self) -> float:
        return self.started + self.check.timeout

    @property
    def result(self) -> CheckResult:
        assert self._result is not None, "result read before the check finished or timed out"
        return self._result

    def _settle(self, result: CheckResult) -> bool:
        with self._lock:
            if self._result is not None:
                return False
            self._result = result
            return True

    def _target(self) -> None:
        try:
            instance = self.check.record.factory(self.check.options, self.context)
            with self._lock:
                self._instance = instance
                late = self._result is not None
            if late:  # timed out while being built: release what the constructor took
                instance.cancel()
                return
            devices = instance.run()
            self._settle(_result(self.check.name, devices, time.monotonic() - self.started))
        except HealthCheckError as exc:
            self._settle(self._error(str(exc)))
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._settle(
                self._error(
                    f"check crashed: {type(exc).__name__}: {exc} "
                    f"(at {where.filename}:{where.lineno})"
                )
            )

    def time_out(self) -> None:
        if not self._settle(self._error(f"timed out after {self.check.timeout:g}s")):
            return
        with self._lock:
            instance = self._instance
        if instance is not None:
            # Cancelling may take a while (a process group's grace period): never let it
            # delay the verdicts of the other checks.
            threading.Thread(target=_cancel, args=(instance,), daemon=True).start()

    def _error(self, message: str) -> CheckResult:
        return CheckResult(
            check=self.check.name,
            status=Status.ERROR,
            duration_s=time.monotonic() - self.started,
            error=message,
        )


def _cancel(instance: HealthCheck[BaseModel]) -> None:
    try:
        instance.cancel()
    except Exception as exc:
        log.warning("cancelling a timed-out health check failed", error=repr(exc))


def _result(name: str, devices: object, duration: float) -> CheckResult:
    if not isinstance(devices, list) or not all(isinstance(d, DeviceResult) for d in devices):
        raise HealthCheckError(
            f"check {name!r} returned {type(devices).__name__}, expected a list of DeviceResult"
        )
    return CheckResult(
        check=name,
        status=Status.worst([d.status for d in devices], default=Status.NOT_APPLICABLE),
        devices=devices,
        duration_s=duration,
    )


def run_checks(
    checks: Sequence[ConfiguredCheck],
    context: CheckContext,
    on_result: Callable[[CheckResult], None] | None = None,
) -> NodeHealth:
    """Run every check concurrently and return the node's health, in the configured order."""
    runs = [_Run(check, context) for check in checks]
    for run in runs:
        run.thread.start()
    # Wait in deadline order so that a slow early check does not delay reporting a fast one.
    for run in sorted(runs, key=lambda r: r.deadline):
        run.thread.join(max(0.0, run.deadline - time.monotonic()))
        if run.thread.is_alive():
            run.time_out()
        if on_result is not None:
            on_result(run.result)
    return NodeHealth(node=context.node, checks=[run.result for run in runs])
