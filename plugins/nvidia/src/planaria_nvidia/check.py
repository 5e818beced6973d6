"""The ``nvidia`` health check: every GPU's health as NVML reports it.

Hardware faults fail a GPU (uncorrectable ECC errors, memory repairs pending or failed, fatal
XIDs, NVLink errors, a missing GPU); soft trouble degrades it (throttling for heat or power,
high temperature, a PCIe link trained below its maximum, memory held by a process that is not
this one or its children: a killed worker's leftover context, another job's process). A probe
a GPU generation does not support (``NVML_ERROR_NOT_SUPPORTED``) is noted and skipped: A100
and later repair memory by remapping rows, older GPUs retire pages.
No driver on the node is a ``not_applicable`` result, never an error.

Why one module: it is one check; each probe is a method of a few lines reading one thing of one
GPU through the same session and noting it on the same :class:`_Probe`. NVML itself
(:mod:`.nvml`, :mod:`.session`), the options, the XID table and the rates are modules of their
own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pynvml

from planaria import process
from planaria.errors import HealthCheckError
from planaria.plugin import CheckContext, DeviceResult, HealthCheck, Status
from planaria_nvidia.nvml import Handle, Nvml
from planaria_nvidia.options import NvidiaOptions, ThrottleReason
from planaria_nvidia.session import NvmlSession, Xids, default_session
from planaria_nvidia.xids import describe

T = TypeVar("T")

NO_DRIVER = (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
# Errors that mean the GPU itself is gone or broken, whatever was being read.
GPU_BROKEN = (
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    pynvml.NVML_ERROR_CORRUPTED_INFOROM,
)
UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

THROTTLE_BITS: dict[ThrottleReason, tuple[int, str]] = {
    ThrottleReason.HW_SLOWDOWN: (pynvml.nvmlClocksThrottleReasonHwSlowdown, "HW slowdown"),
    ThrottleReason.HW_THERMAL: (
        pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
        "HW thermal slowdown",
    ),
    ThrottleReason.HW_POWER_BRAKE: (
        pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
        "HW power brake",
    ),
    ThrottleReason.SW_THERMAL: (
        pynvml.nvmlClocksThrottleReasonSwThermalSlowdown,
        "SW thermal slowdown",
    ),
    ThrottleReason.SW_POWER_CAP: (pynvml.nvmlClocksThrottleReasonSwPowerCap, "SW power cap"),
}

NVLINK_COUNTERS: dict[str, tuple[int, ...]] = {
    "crc": (pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    "replay": (pynvml.NVML_NVLINK_ERROR_DL_REPLAY,),
    "recovery": (pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,),
}

MIB = 1 << 20


def _mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB"


def job_pids() -> set[int]:
    """This process and its descendants (an agent's workers): the GPU memory they hold is the
    job's own. In a container without the host's pid namespace NVML names host pids, which
    match none of these: turn ``flag_foreign_processes`` off there."""
    children: dict[int, list[int]] = {}
    for pid, stat in process.processes():
        children.setdefault(stat.ppid, []).append(pid)
    found = {os.getpid()}
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _describe_process(pid: int, held: int) -> str:
    gone = "" if process.running(pid) else ", exited: a leftover context"
    return f"pid {pid} ({_mib(held)}{gone})"


class _Probe:
    """One GPU's findings: problems with their severity, notes, and metrics."""

    def __init__(self, index: int) -> None:
        self.device = f"gpu{index}"
        self.problems: list[tuple[Status, str]] = []
        self.notes: list[str] = []
        self.unsupported: list[str] = []
        self.metrics: dict[str, float] = {}

    def problem(self, status: Status, message: str) -> None:
        self.problems.append((status, message))

    def read(self, what: str, call: Callable[[], T]) -> T | None:
        """Run one NVML call; ``None`` when this GPU cannot answer it, with the reason kept."""
        try:
            return call()
        except pynvml.NVMLError as exc:
            self.failed_read(what, exc)
            return None

    def failed_read(self, what: str, exc: pynvml.NVMLError) -> None:
        if exc.value in UNSUPPORTED:
            self.unsupported.append(what)
        elif exc.value in GPU_BROKEN:
            self.problem(Status.FAILED, f"{what}: {exc} (NVML error {exc.value})")
        else:  # a GPU that cannot be verified is not trusted ('error' is the runner's)
            self.problem(Status.FAILED, f"reading {what} failed: {exc} (NVML error {exc.value})")

    def result(self, summary: str) -> DeviceResult:
        status = Status.worst([s for s, _ in self.problems], default=Status.OK)
        parts = [m for _, m in sorted(self.problems, key=lambda p: -p[0].severity)]
        if not parts:
            parts.append(summary)
        parts += self.notes
        if self.unsupported:
            parts.append(f"not supported here: {', '.join(self.unsupported)}")
        return DeviceResult(
            device=self.device, status=status, detail="; ".join(parts), metrics=self.metrics
        )


class NvidiaCheck(HealthCheck[NvidiaOptions]):
    """Reads each GPU through an :class:`~planaria_nvidia.session.NvmlSession`: the process's
    real one by default, a fake one in tests."""

    name = "nvidia"

    def __init__(
        self, options: NvidiaOptions, context: CheckContext, session: NvmlSession | None = None
    ) -> None:
        super().__init__(options, context)
        self.session = session if session is not None else default_session()

    @property
    def nvml(self) -> Nvml:
        return self.session.nvml

    def run(self) -> list[DeviceResult]:
        try:
            self.session.start()
        except pynvml.NVMLError as exc:
            if exc.value in NO_DRIVER:
                return [
                    DeviceResult(
                        device="nvidia",
                        status=Status.NOT_APPLICABLE,
                        detail=f"no NVIDIA driver on this node: NVML cannot start ({exc})",
                    )
                ]
            raise HealthCheckError(
                f"NVML cannot start: {exc} (NVML error {exc.value}); "
                "check the driver with nvidia-smi"
            ) from exc
        try:
            xids = self.session.poll_xids()
            count = self.nvml.device_get_count()
        except pynvml.NVMLError as exc:
            raise HealthCheckError(f"NVML failed: {exc} (NVML error {exc.value})") from exc
        results = [self._inventory(count)]
        results += [self._gpu(index, xids) for index in range(count)]
        unattributed = xids.by_device.get(None, [])
        strays = [i for i in xids.by_device if i is not None and i >= count]
        for index in strays:
            unattributed += xids.by_device[index]
        if unattributed:
            results.append(self._xid_result("gpu?", unattributed))
        if xids.truncated:
            results.append(
                DeviceResult(
                    device="xid-events",
                    status=Status.DEGRADED,
                    detail="more XID events were waiting than one check reads; "
                    "the rest are read by the next check",
                )
            )
        return results

    def _inventory(self, count: int) -> DeviceResult:
        try:
            driver = f"driver {self.nvml.system_get_driver_version()}"
        except pynvml.NVMLError as exc:
            driver = f"driver version unknown ({exc})"
        expected = self.options.expected_devices
        metrics = {"devices": float(count)}
        if expected is not None and count != expected:
            return DeviceResult(
                device="nvidia",
                status=Status.FAILED,
                detail=f"found {count} GPU(s), expected {expected} ({driver})",
                metrics=metrics,
            )
        if count == 0:
            return DeviceResult(
                device="nvidia",
                status=Status.FAILED,
                detail=f"the NVIDIA driver is loaded but reports no GPU ({driver})",
                metrics=metrics,
            )
        return DeviceResult(
            device="nvidia", status=Status.OK, detail=f"{count} GPU(s), {driver}", metrics=metrics
        )

    def _gpu(self, index: int, xids: Xids) -> DeviceResult:
        probe = _Probe(index)
        handle = probe.read("device handle", lambda: self.nvml.device_get_handle_by_index(index))
        if handle is None:
            if not probe.problems:
                probe.problem(Status.FAILED, "NVML returns no handle for this GPU")
            return probe.result("")
        name = probe.read("name", lambda: self.nvml.device_get_name(handle)) or "NVIDIA GPU"
        self._ecc(probe, handle)
        self._memory_repair(probe, handle)
        self._throttling(probe, handle)
        temperature = self._temperature(probe, handle)
        self._nvlink(probe, handle)
        link = self._pcie(probe, handle)
        self._memory(probe, handle)
        self._xids(probe, index, xids.by_device.get(index, []))
        summary = name if temperature is None else f"{name}, {temperature} C"
        return probe.result(summary if link is None else f"{summary}, {link}")

    def _ecc(self, probe: _Probe, handle: Handle) -> None:
        count = probe.read(
            "ECC counters",
            lambda: self.nvml.device_get_total_ecc_errors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            ),
        )
        if count is None:
            return
        probe.metrics["ecc_uncorrectable_volatile"] = float(count)
        limit = self.options.max_uncorrectable_ecc
        if count > limit:
            probe.problem(
                Status.FAILED,
                f"{count} uncorrectable ECC error(s) since the driver loaded (max {limit})",
            )

    def _memory_repair(self, probe: _Probe, handle: Handle) -> None:
        # Ampere and later remap rows; earlier GPUs retire pages and answer NOT_SUPPORTED to
        # the other, so asking for remapped rows first costs one call on old GPUs.
        rows = probe.read("remapped rows", lambda: self.nvml.device_get_remapped_rows(handle))
        if rows is not None:
            corrected, uncorrected, pending, failure = rows
            probe.metrics.update(
                remapped_rows_correctable=float(corrected),
                remapped_rows_uncorrectable=float(uncorrected),
                remapped_rows_pending=float(pending),
                remapped_rows_failure=float(failure),
            )
            if failure:
                probe.problem(
                    Status.FAILED,
                    "row remapping failed: the GPU's memory cannot be repaired any more",
                )
            if pending:
                probe.problem(
                    Status.FAILED, "row remapping pending: reset the GPU to repair its memory"
                )
            return
        pending_pages = probe.read(
            "retired pages",
            lambda: self.nvml.device_get_retired_pages_pending_status(handle),
        )
        if pending_pages is None:
            return
        retired = 0
        for cause, label in (
            (pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, "double_bit"),
            (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, "single_bit"),
        ):
            try:
                pages = self.nvml.device_get_retired_pages(handle, cause)
            except pynvml.NVMLError as exc:
                probe.failed_read("retired pages", exc)
                continue
            probe.metrics[f"retired_pages_{label}"] = float(len(pages))
            retired += len(pages)
        probe.metrics["retired_pages_pending"] = float(pending_pages)
        if pending_pages:
            probe.problem(
                Status.FAILED,
                "retired pages pending: reset the GPU (or reload the driver) to retire them",
            )
        limit = self.options.max_retired_pages
        if retired >= limit:
            probe.problem(
                Status.FAILED,
                f"{retired} retired pages (limit {limit}): page retirement is running out",
            )

    def _throttling(self, probe: _Probe, handle: Handle) -> None:
        reasons = probe.read(
            "clock event reasons",
            lambda: self.nvml.device_get_current_clocks_event_reasons(handle),
        )
        if reasons is None:
            return
        probe.metrics["clocks_event_reasons"] = float(reasons)
        active = [
            label
            for reason in self.options.throttle_reasons
            for bit, label in [THROTTLE_BITS[reason]]
            if reasons & bit
        ]
        if active:
            probe.problem(Status.DEGRADED, f"clocks throttled: {', '.join(active)}")

    def _temperature(self, probe: _Probe, handle: Handle) -> int | None:
        temperature = probe.read(
            "temperature",
            lambda: self.nvml.device_get_temperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        )
        if temperature is None:
            return None
        probe.metrics["temperature_c"] = float(temperature)
        limit = self.options.max_temperature
        if temperature > limit:
            probe.problem(Status.DEGRADED, f"temperature {temperature} C (max {limit} C)")
        return temperature

    def _nvlink(self, probe: _Probe, handle: Handle) -> None:
        opts = self.options
        limits = {
            "crc": opts.max_nvlink_crc_errors,
            "replay": opts.max_nvlink_replay_errors,
            "recovery": opts.max_nvlink_recovery_errors,
        }
        totals = dict.fromkeys(limits, 0)
        active = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = self.nvml.device_get_nvlink_state(handle, link)
            except pynvml.NVMLError as exc:
                # Links are numbered from 0: the first one the GPU refuses ends its list.
                if link == 0 and exc.value in UNSUPPORTED:
                    probe.unsupported.append("NVLink")
                    return
                if exc.value not in (*UNSUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    probe.failed_read(f"NVLink {link} state", exc)
                break
            if not state:
                continue
            active += 1
            for name, counters in NVLINK_COUNTERS.items():
                try:
                    value = sum(
                        self.nvml.device_get_nvlink_error_counter(handle, link, counter)
                        for counter in counters
                    )
                except pynvml.NVMLError as exc:
                    probe.failed_read(f"NVLink {link} {name} errors", exc)
                    continue
                totals[name] += value
                if value > limits[name]:
                    probe.problem(
                        Status.FAILED, f"NVLink {link}: {value} {name} errors (max {limits[name]})"
                    )
        probe.metrics["nvlink_active_links"] = float(active)
        for name, total in totals.items():
            probe.metrics[f"nvlink_{name}_errors"] = float(total)

    def _pcie(self, probe: _Probe, handle: Handle) -> str | None:
        """The link as ``PCIe gen 5 x16``, or None when this GPU cannot say.

        A narrower link than the GPU's maximum degrades it: links keep their width at idle, so
        a lower one is a bad slot, riser or cable. A lower generation degrades it only while the
        GPU is busy: many GPUs train their link down to gen 1 at idle to save power and back up
        under load, so at idle it is only noted."""
        calls = {
            "generation": self.nvml.device_get_curr_pcie_link_generation,
            "max_generation": self.nvml.device_get_max_pcie_link_generation,
            "width": self.nvml.device_get_curr_pcie_link_width,
            "max_width": self.nvml.device_get_max_pcie_link_width,
        }
        link: dict[str, int] = {}
        for key, call in calls.items():
            try:
                link[key] = call(handle)
            except pynvml.NVMLError as exc:
                if exc.value in UNSUPPORTED:
                    probe.unsupported.append("PCIe link")
                else:
                    probe.failed_read("PCIe link", exc)
                return None
        gen, max_gen, width, max_width = (
            link["generation"],
            link["max_generation"],
            link["width"],
            link["max_width"],
        )
        probe.metrics.update(
            pcie_generation=float(gen),
            pcie_max_generation=float(max_gen),
            pcie_width=float(width),
            pcie_max_width=float(max_width),
        )
        if width < max_width:
            probe.problem(
                Status.DEGRADED,
                f"PCIe link x{width} of x{max_width} (gen {gen} of {max_gen}): the slot, riser "
                "or cable trained it narrower, host copies run slower",
            )
        elif gen < max_gen:
            rates = probe.read(
                "utilization", lambda: self.nvml.device_get_utilization_rates(handle)
            )
            busy = 0 if rates is None else int(rates.gpu)
            if rates is not None:
                probe.metrics["utilization_gpu"] = float(busy)
            if busy:
                probe.problem(
                    Status.DEGRADED,
                    f"PCIe link gen {gen} of {max_gen} while the GPU is busy ({busy}%)",
                )
            else:
                probe.notes.append(
                    f"PCIe link at gen {gen} of {max_gen} while idle (links train down at idle; "
                    "judged only under load)"
                )
        return f"PCIe gen {gen} x{width}"

    def _memory(self, probe: _Probe, handle: Handle) -> None:
        info = probe.read("memory", lambda: self.nvml.device_get_memory_info(handle))
        if info is not None:
            probe.metrics["memory_used_bytes"] = float(info.used)
            probe.metrics["memory_total_bytes"] = float(info.total)
        limit = self.options.max_foreign_memory
        if limit is None and not self.options.flag_foreign_processes:
            return
        processes = probe.read(
            "running processes", lambda: self.nvml.device_get_compute_running_processes(handle)
        )
        if processes is None:
            return
        ours = job_pids()
        others = [p for p in processes if p.pid not in ours]
        # usedGpuMemory is None where the driver cannot tell (WDDM); count those as 0.
        held = sum(p.usedGpuMemory or 0 for p in others)
        probe.metrics["foreign_processes"] = float(len(others))
        probe.metrics["foreign_memory_bytes"] = float(held)
        if not others:
            return
        listed = ", ".join(_describe_process(p.pid, p.usedGpuMemory or 0) for p in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        if limit is not None and held > limit:
            probe.problem(
                Status.FAILED,
                f"{_mib(held)} already held by other processes (max {_mib(limit)}): {listed}{more}",
            )
        elif self.options.flag_foreign_processes:
            probe.problem(
                Status.DEGRADED,
                f"{_mib(held)} held by processes not of this job: {listed}{more}",
            )

    def _xids(self, probe: _Probe, index: int, seen: list[int]) -> None:
        reason = self.session.xid_unsupported.get(index)
        if reason is not None:
            probe.notes.append(f"XID events cannot be watched here ({reason})")
        self._classify_xids(probe, seen)

    def _classify_xids(self, probe: _Probe, seen: list[int]) -> None:
        probe.metrics["xid_events"] = float(len(seen))
        fatal, degraded = set(self.options.fatal_xids), set(self.options.degraded_xids)
        for xid in sorted(set(seen)):
            times = seen.count(xid)
            text = describe(xid) + (f" x{times}" if times > 1 else "")
            if xid in fatal:
                probe.problem(Status.FAILED, f"{text} since the last check")
            elif xid in degraded:
                probe.problem(Status.DEGRADED, f"{text} since the last check")
            else:
                probe.notes.append(f"{text} since the last check (not a hardware fault)")

    def _xid_result(self, device: str, seen: list[int]) -> DeviceResult:
        probe = _Probe(0)
        probe.device = device
        self._classify_xids(probe, seen)
        return probe.result("XID events NVML attributes to no known GPU")
