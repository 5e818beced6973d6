"""The boundary to NVML: every call this plugin makes into the driver, and nothing else.

:class:`Nvml` is the interface the check is written against; :class:`Pynvml` implements it with
``pynvml`` (the ``nvidia-ml-py`` distribution). Each method is one NVML call, returns what pynvml
returns (ints, ``str``, tuples, ctypes structures such as ``c_nvmlMemory_t``) and raises what it
raises (``pynvml.NVMLError`` subclasses carrying the NVML return code in ``.value``). Keeping the
boundary this thin is what lets tests replace it with a fake that answers exactly like NVML.
"""

from __future__ import annotations

from typing import Any, Protocol

import pynvml

Handle = Any
"""A ``pynvml.c_nvmlDevice_t``."""

EventSet = Any
"""A ``pynvml.c_nvmlEventSet_t``."""

# pynvml renamed "clocks throttle reasons" to "clocks event reasons"; older releases have only
# the first name, newer ones both. The bit values are the same.
_clocks_reasons = getattr(
    pynvml,
    "nvmlDeviceGetCurrentClocksEventReasons",
    getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
)


class Nvml(Protocol):
    def init(self) -> None: ...
    def system_get_driver_version(self) -> str: ...
    def device_get_count(self) -> int: ...
    def device_get_handle_by_index(self, index: int) -> Handle: ...
    def device_get_index(self, handle: Handle) -> int: ...
    def device_get_name(self, handle: Handle) -> str: ...
    def device_get_uuid(self, handle: Handle) -> str: ...
    def device_get_total_ecc_errors(
        self, handle: Handle, error_type: int, counter_type: int
    ) -> int: ...
    def device_get_remapped_rows(self, handle: Handle) -> tuple[int, int, int, int]: ...
    def device_get_retired_pages(self, handle: Handle, cause: int) -> list[int]: ...
    def device_get_retired_pages_pending_status(self, handle: Handle) -> int: ...
    def device_get_current_clocks_event_reasons(self, handle: Handle) -> int: ...
    def device_get_temperature(self, handle: Handle, sensor: int) -> int: ...
    def device_get_nvlink_state(self, handle: Handle, link: int) -> int: ...
    def device_get_nvlink_error_counter(self, handle: Handle, link: int, counter: int) -> int: ...
    def device_get_memory_info(self, handle: Handle) -> Any: ...
    def device_get_compute_running_processes(self, handle: Handle) -> list[Any]: ...
    def device_get_curr_pcie_link_generation(self, handle: Handle) -> int: ...
    def device_get_max_pcie_link_generation(self, handle: Handle) -> int: ...
    def device_get_curr_pcie_link_width(self, handle: Handle) -> int: ...
    def device_get_max_pcie_link_width(self, handle: Handle) -> int: ...
    def device_get_utilization_rates(self, handle: Handle) -> Any: ...
    def event_set_create(self) -> EventSet: ...
    def device_register_events(
        self, handle: Handle, event_types: int, event_set: EventSet
    ) -> None: ...
    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> Any: ...


class Pynvml:
    """:class:`Nvml` through pynvml: one line per call."""

    def init(self) -> None:
        pynvml.nvmlInit()

    def system_get_driver_version(self) -> str:
        return str(pynvml.nvmlSystemGetDriverVersion())

    def device_get_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def device_get_handle_by_index(self, index: int) -> Handle:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def device_get_index(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetIndex(handle))

    def device_get_name(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetName(handle))

    def device_get_uuid(self, handle: Handle) -> str:
        return str(pynvml.nvmlDeviceGetUUID(handle))

    def device_get_total_ecc_errors(
        self, handle: Handle, error_type: int, counter_type: int
    ) -> int:
        return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))

    def device_get_remapped_rows(self, handle: Handle) -> tuple[int, int, int, int]:
        corrected, uncorrected, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
        return corrected, uncorrected, pending, failed

    def device_get_retired_pages(self, handle: Handle, cause: int) -> list[int]:
        return list(pynvml.nvmlDeviceGetRetiredPages(handle, cause))

    def device_get_retired_pages_pending_status(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))

    def device_get_current_clocks_event_reasons(self, handle: Handle) -> int:
        if _clocks_reasons is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return int(_clocks_reasons(handle))

    def device_get_temperature(self, handle: Handle, sensor: int) -> int:
        return int(pynvml.nvmlDeviceGetTemperature(handle, sensor))

    def device_get_nvlink_state(self, handle: Handle, link: int) -> int:
        return int(pynvml.nvmlDeviceGetNvLinkState(handle, link))

    def device_get_nvlink_error_counter(self, handle: Handle, link: int, counter: int) -> int:
        return int(pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))

    def device_get_memory_info(self, handle: Handle) -> Any:
        return pynvml.nvmlDeviceGetMemoryInfo(handle)

    def device_get_compute_running_processes(self, handle: Handle) -> list[Any]:
        return list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

    def device_get_curr_pcie_link_generation(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))

    def device_get_max_pcie_link_generation(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))

    def device_get_curr_pcie_link_width(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))

    def device_get_max_pcie_link_width(self, handle: Handle) -> int:
        return int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))

    def device_get_utilization_rates(self, handle: Handle) -> Any:
        return pynvml.nvmlDeviceGetUtilizationRates(handle)

    def event_set_create(self) -> EventSet:
        return pynvml.nvmlEventSetCreate()

    def device_register_events(self, handle: Handle, event_types: int, event_set: EventSet) -> None:
        pynvml.nvmlDeviceRegisterEvents(handle, event_types, event_set)

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> Any:
        return pynvml.nvmlEventSetWait(event_set, timeout_ms)
