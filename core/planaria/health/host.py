"""The ``host`` health check: free disk where the job writes, /dev/shm size, available memory.

Flash checkpoints live in /dev/shm and persisted ones on disk, so a node short of either fails
later at the worst moment; this check fails it before training starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ByteSize, ConfigDict, Field

from planaria.health.api import DeviceResult, HealthCheck, HealthCheckRecord, Status
from planaria.plugin import hookimpl

GIB = 1 << 30


class HostOptions(BaseModel):
    """Thresholds accept sizes such as ``10GiB`` or ``500MB``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_free_disk: ByteSize = Field(default=ByteSize(1 * GIB), description="per path")
    min_shm: ByteSize = Field(default=ByteSize(64 << 20), description="size of /dev/shm")
    min_available_memory: ByteSize = Field(default=ByteSize(1 * GIB))
    paths: list[Path] = Field(
        default_factory=list,
        description="directories to check for free disk, besides the job's work dir",
    )
    shm_path: Path = Path("/dev/shm")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _existing_parent(path: Path) -> Path:
    """A path that does not exist yet will be created under its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostCheck(HealthCheck[HostOptions]):
    def run(self) -> list[DeviceResult]:
        opts = self.options
        results = [self._disk(p) for p in self._paths()]
        results.append(self._shm(opts.shm_path))
        results.append(self._memory())
        return results

    def _paths(self) -> Iterable[Path]:
        seen: set[Path] = set()
        for path in (self.context.workdir, *self.context.paths, *self.options.paths):
            resolved = path.absolute()
            if resolved not in seen:
                seen.add(resolved)
                yield resolved

    def _disk(self, path: Path) -> DeviceResult:
        usage = shutil.disk_usage(_existing_parent(path))
        minimum = self.options.min_free_disk
        status = Status.OK if usage.free >= minimum else Status.FAILED
        return DeviceResult(
            device=f"disk:{path}",
            status=status,
            detail=f"{_human(usage.free)} free (minimum {_human(minimum)})",
            metrics={"free_bytes": float(usage.free), "total_bytes": float(usage.total)},
        )

    def _shm(self, path: Path) -> DeviceResult:
        if not path.is_dir():
            return DeviceResult(device="shm", status=Status.FAILED, detail=f"{path} does not exist")
        st = os.statvfs(path)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        minimum = self.options.min_shm
        status = Status.OK if size >= minimum else Status.FAILED
        return DeviceResult(
            device="shm",
            status=status,
            detail=f"{path}: {_human(size)} ({_human(free)} free; minimum size {_human(minimum)})",
            metrics={"size_bytes": float(size), "free_bytes": float(free)},
        )

    def _memory(self) -> DeviceResult:
        available = available_memory_bytes()
        if available is None:
            return DeviceResult(
                device="memory",
                status=Status.NOT_APPLICABLE,
                detail="/proc/meminfo has no MemAvailable on this system",
            )
        minimum = self.options.min_available_memory
        return DeviceResult(
            device="memory",
            status=Status.OK if available >= minimum else Status.FAILED,
            detail=f"{_human(available)} available (minimum {_human(minimum)})",
            metrics={"available_bytes": float(available)},
        )


@hookimpl
def planaria_health_checks() -> Iterable[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="host",
        factory=HostCheck,
        options=HostOptions,
        summary="free disk where the job writes, /dev/shm size, available memory",
    )
