"""The health-check interface: what a check returns and how a node's verdict is formed.

A check answers for the devices it knows (GPUs, NPUs, disks, memory). A missing driver is a
``not_applicable`` result, never an exception; an exception or a timeout means the check itself
could not reach a verdict, which the runner reports as ``error``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator

from planaria.plugin.records import PluginKind, PluginRecord


class Status(str, Enum):
    """The verdict on one device, or on a whole check."""

    OK = "ok"
    NOT_APPLICABLE = "not_applicable"
    DEGRADED = "degraded"
    FAILED = "failed"
    ERROR = "error"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]

    @property
    def healthy(self) -> bool:
        """``ok``, ``not_applicable`` and ``degraded`` let a node train; the rest do not."""
        return self not in (Status.FAILED, Status.ERROR)

    @classmethod
    def worst(cls, statuses: list[Status], default: Status | None = None) -> Status:
        if not statuses:
            return default if default is not None else cls.OK
        return max(statuses, key=lambda s: s.severity)


_SEVERITY = {
    Status.OK: 0,
    Status.NOT_APPLICABLE: 1,
    Status.DEGRADED: 2,
    Status.FAILED: 3,
    Status.ERROR: 4,
}


class DeviceResult(BaseModel):
    """One device's verdict: ``DeviceResult(device="gpu0", status=Status.FAILED, detail="...")``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(min_length=1)
    status: Status
    detail: str = ""
    metrics: dict[str, StrictInt | StrictFloat] = Field(default_factory=dict)
    """Numbers only: a boolean or a numeric string is a mistake of the check, not a metric."""

    @field_validator("status")
    @classmethod
    def _not_error(cls, status: Status) -> Status:
        # ``error`` says the check itself reached no verdict: only the runner knows that, from
        # the check raising or overrunning its timeout. A device is judged, never ``error``.
        if status is Status.ERROR:
            raise ValueError(
                "a device's status cannot be 'error': that is the runner's verdict on a check "
                "that raised or timed out. Give 'failed' to a device that is bad or cannot be "
                "verified, or raise planaria.errors.HealthCheckError when the check cannot "
                "decide at all"
            )
        return status


class CheckContext(BaseModel):
    """What a check may need to know about the node and the job it runs for."""

    model_config = ConfigDict(frozen=True)

    node: str
    workdir: Path
    paths: tuple[Path, ...] = ()
    """Directories the job writes to (work dir, checkpoint dir): checks of free space look here."""


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class HealthCheck(ABC, Generic[OptionsT]):
    """Base class of every health check.

    A subclass receives its validated options (the ``Options`` model named in its record) and the
    node's context, and implements :meth:`run`::

        class LoadCheck(HealthCheck[LoadOptions]):
            def run(self) -> list[DeviceResult]:
                load = os.getloadavg()[0]
                status = Status.OK if load < self.options.max_load else Status.DEGRADED
                return [DeviceResult(device="cpu", status=status, detail=f"load {load:.1f}")]
    """

    name: ClassVar[str] = ""

    def __init__(self, options: OptionsT, context: CheckContext) -> None:
        self.options = options
        self.context = context

    @abstractmethod
    def run(self) -> list[DeviceResult]:
        """Inspect the node and return one result per device.

        Return a ``not_applicable`` result when the hardware or driver is absent. Raise
        :class:`planaria.errors.HealthCheckError` when the check cannot reach a verdict.
        The runner calls this in its own thread with a timeout, so it may block.
        """

    def cancel(self) -> None:
        """Called from another thread when :meth:`run` overran its timeout.

        A check that owns resources (a child process, a device handle) releases them here;
        the runner has already reported the timeout and will not wait for :meth:`run`.
        """


class CheckResult(BaseModel):
    """The outcome of one configured check on one node."""

    model_config = ConfigDict(frozen=True)

    check: str
    status: Status
    devices: list[DeviceResult] = Field(default_factory=list)
    duration_s: float = 0.0
    error: str | None = None


class NodeHealth(BaseModel):
    """Every check's outcome on one node, and the node's verdict."""

    model_config = ConfigDict(frozen=True)

    node: str
    checks: list[CheckResult]

    @property
    def status(self) -> Status:
        return Status.worst([c.status for c in self.checks])

    @property
    def healthy(self) -> bool:
        return all(c.status.healthy for c in self.checks)


class HealthCheckRecord(PluginRecord):
    """``HealthCheckRecord(name="host", factory=HostCheck, options=HostOptions, summary=...)``"""

    kind: ClassVar[PluginKind] = PluginKind.HEALTH_CHECK
    well_known: ClassVar[dict[str, str]] = {
        "nvidia": "planaria-nvidia",
        "ascend": "planaria-ascend",
        "custom_script": "planaria-custom-script",
    }
    factory: type[HealthCheck]  # type: ignore[type-arg]  # pydantic rejects type[X[Any]]
