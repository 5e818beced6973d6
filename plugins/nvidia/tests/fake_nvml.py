"""A fake of :class:`planaria_nvidia.nvml.Nvml` that answers exactly as pynvml does.

It is driven by a JSON fixture (``fixtures/*.json``) describing a node. Values come back in
pynvml's own types: ``c_nvmlDevice_t`` handles, a ``c_nvmlMemory_t``, process objects made by
``nvmlStructToFriendlyObject`` from ``c_nvmlProcessInfo_v3_t``, ``c_nvmlEventData_t`` events,
and ints and tuples where pynvml returns those. Errors are pynvml's: a field written as
``{"nvml_error": "NVML_ERROR_NOT_SUPPORTED"}`` raises ``pynvml.NVMLError(code)``, which pynvml
turns into its subclass (``NVMLError_NotSupported``) as it does for a real return code.

Fixture layout::

    {"driver_version": "...", "count": 8, "device": {<every GPU>},
     "devices": {"3": {<fields of GPU 3 that differ>}}, "init_error": "NVML_ERROR_..."}

A fault fixture names a ``"base"`` fixture and lists only what differs.
"""

from __future__ import annotations

import copy
import ctypes
import json
from pathlib import Path
from typing import Any

import pynvml

FIXTURES = Path(__file__).parent / "fixtures"

_CAUSES = {
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "double_bit",
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "single_bit",
}
_NVLINK_COUNTERS = {
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and "nvml_error" not in value:
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    base = data.pop("base", None)
    if base is not None:
        data = _merge(load_fixture(base), data)
    return data


def _error(name: str) -> pynvml.NVMLError:
    return pynvml.NVMLError(getattr(pynvml, name))


def _answer(value: Any) -> Any:
    if isinstance(value, dict) and "nvml_error" in value:
        raise _error(value["nvml_error"])
    return value


class FakeNvml:
    """Implements :class:`~planaria_nvidia.nvml.Nvml` over a fixture; records every call."""

    def __init__(self, fixture: dict[str, Any] | str) -> None:
        self.fixture = load_fixture(fixture) if isinstance(fixture, str) else fixture
        count = int(self.fixture["count"])
        overrides = self.fixture.get("devices", {})
        self.devices = [
            _merge(self.fixture["device"], overrides.get(str(i), {})) for i in range(count)
        ]
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in range(count)]
        self._by_address = {ctypes.addressof(s): i for i, s in enumerate(self._structs)}
        self.initialised = False
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._event_sets: list[Any] = []
        self._registered: set[int] = set()
        self._queue: list[tuple[int | None, int]] = []

    # -- the fake's own controls --------------------------------------------------------------
    def raise_xid(self, index: int | None, xid: int) -> None:
        """The driver reports an XID on GPU ``index`` (``None``: on no particular GPU)."""
        if index is None or index in self._registered:
            self._queue.append((index, xid))

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name != "init" and not self.initialised:
            raise _error("NVML_ERROR_UNINITIALIZED")

    def _device(self, handle: Any) -> dict[str, Any]:
        return self.devices[self._index(handle)]

    def _index(self, handle: Any) -> int:
        if not isinstance(handle, pynvml.c_nvmlDevice_t) or not handle:
            raise _error("NVML_ERROR_INVALID_ARGUMENT")
        return self._by_address[ctypes.addressof(handle.contents)]

    # -- Nvml ----------------------------------------------------------------------------------
    def init(self) -> None:
        self._call("init")
        error = self.fixture.get("init_error")
        if error:
            raise _error(error)
        self.initialised = True

    def system_get_driver_version(self) -> str:
        self._call("system_get_driver_version")
        return str(self.fixture["driver_version"])

    def device_get_count(self) -> int:
        self._call("device_get_count")
        return len(self.devices)

    def device_get_handle_by_index(self, index: int) -> Any:
        self._call("device_get_handle_by_index", index)
        if not 0 <= index < len(self.devices):
            raise _error("NVML_ERROR_INVALID_ARGUMENT")
        _answer(self.devices[index].get("handle", None))
        return pynvml.c_nvmlDevice_t(self._structs[index])

    def device_get_index(self, handle: Any) -> int:
        self._call("device_get_index", handle)
        return self._index(handle)

    def device_get_name(self, handle: Any) -> str:
        self._call("device_get_name", handle)
        return str(_answer(self._device(handle)["name"]))

    def device_get_uuid(self, handle: Any) -> str:
        self._call("device_get_uuid", handle)
        return f"{self._device(handle)['uuid_prefix']}{self._index(handle):04x}"

    def device_get_total_ecc_errors(self, handle: Any, error_type: int, counter_type: int) -> int:
        self._call("device_get_total_ecc_errors", handle, error_type, counter_type)
        ecc = _answer(self._device(handle)["ecc"])
        kind = (
            "uncorrected"
            if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            else "corrected"
        )
        scope = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        return int(ecc[f"{kind}_{scope}"])

    def device_get_remapped_rows(self, handle: Any) -> tuple[int, int, int, int]:
        self._call("device_get_remapped_rows", handle)
        rows = _answer(self._device(handle)["remapped_rows"])
        return (
            int(rows["correctable"]),
            int(rows["uncorrectable"]),
            int(rows["pending"]),
            int(rows["failure"]),
        )

    def device_get_retired_pages(self, handle: Any, cause: int) -> list[int]:
        self._call("device_get_retired_pages", handle, cause)
        pages = _answer(self._device(handle)["retired_pages"])
        return [int(a, 16) for a in pages[_CAUSES[cause]]]

    def device_get_retired_pages_pending_status(self, handle: Any) -> int:
        self._call("device_get_retired_pages_pending_status", handle)
        pages = _answer(self._device(handle)["retired_pages"])
        return int(pages["pending"])

    def device_get_current_clocks_event_reasons(self, handle: Any) -> int:
        self._call("device_get_current_clocks_event_reasons", handle)
        return int(_answer(self._device(handle)["clocks_event_reasons"]))

    def device_get_temperature(self, handle: Any, sensor: int) -> int:
        self._call("device_get_temperature", handle, sensor)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error("NVML_ERROR_INVALID_ARGUMENT")
        return int(_answer(self._device(handle)["temperature"]))

    def _link(self, handle: Any, link: int) -> dict[str, Any]:
        nvlink = _answer(self._device(handle)["nvlink"])
        if not 0 <= link < int(nvlink["links"]):
            # What NVML answers for a link number past the GPU's last link.
            raise _error("NVML_ERROR_INVALID_ARGUMENT")
        return nvlink  # type: ignore[no-any-return]

    def device_get_nvlink_state(self, handle: Any, link: int) -> int:
        self._call("device_get_nvlink_state", handle, link)
        nvlink = self._link(handle, link)
        return 0 if link in nvlink.get("inactive", []) else 1

    def device_get_nvlink_error_counter(self, handle: Any, link: int, counter: int) -> int:
        self._call("device_get_nvlink_error_counter", handle, link, counter)
        nvlink = self._link(handle, link)
        counters = nvlink.get("counters", {}).get(str(link), {})
        return int(_answer(counters.get(_NVLINK_COUNTERS[counter], 0)))

    def device_get_memory_info(self, handle: Any) -> Any:
        self._call("device_get_memory_info", handle)
        memory = _answer(self._device(handle)["memory"])
        return pynvml.c_nvmlMemory_t(
            total=memory["total"], free=memory["total"] - memory["used"], used=memory["used"]
        )

    def device_get_compute_running_processes(self, handle: Any) -> list[Any]:
        self._call("device_get_compute_running_processes", handle)
        processes = _answer(self._device(handle)["processes"])
        found = []
        for process in processes:
            info = pynvml.c_nvmlProcessInfo_v3_t(
                pid=process["pid"],
                usedGpuMemory=process["used_gpu_memory"],
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
            found.append(pynvml.nvmlStructToFriendlyObject(info))
        return found

    def _pcie(self, name: str, handle: Any, field: str) -> int:
        self._call(name, handle)
        return int(_answer(_answer(self._device(handle)["pcie"])[field]))

    def device_get_curr_pcie_link_generation(self, handle: Any) -> int:
        return self._pcie("device_get_curr_pcie_link_generation", handle, "current_generation")

    def device_get_max_pcie_link_generation(self, handle: Any) -> int:
        return self._pcie("device_get_max_pcie_link_generation", handle, "max_generation")

    def device_get_curr_pcie_link_width(self, handle: Any) -> int:
        return self._pcie("device_get_curr_pcie_link_width", handle, "current_width")

    def device_get_max_pcie_link_width(self, handle: Any) -> int:
        return self._pcie("device_get_max_pcie_link_width", handle, "max_width")

    def device_get_utilization_rates(self, handle: Any) -> Any:
        self._call("device_get_utilization_rates", handle)
        rates = _answer(self._device(handle)["utilization"])
        return pynvml.c_nvmlUtilization_t(gpu=rates["gpu"], memory=rates["memory"])

    def event_set_create(self) -> Any:
        self._call("event_set_create")
        _answer(self.fixture.get("event_set", None))
        event_set = pynvml.c_nvmlEventSet_t(pynvml.struct_c_nvmlEventSet_t())
        self._event_sets.append(event_set)
        for xid in self.fixture.get("unattributed_xids", []):
            self._queue.append((None, xid))
        return event_set

    def device_register_events(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._call("device_register_events", handle, event_types, event_set)
        device = self._device(handle)
        _answer(device.get("register_events", None))
        if event_types & ~pynvml.nvmlEventTypeXidCriticalError:
            raise _error("NVML_ERROR_NOT_SUPPORTED")
        index = self._index(handle)
        self._registered.add(index)
        # XIDs the fixture says happen while the job runs: raised after registration.
        for xid in device.get("xid_events", []):
            self.raise_xid(index, xid)

    def event_set_wait(self, event_set: Any, timeout_ms: int) -> Any:
        self._call("event_set_wait", event_set, timeout_ms)
        if not self._queue:
            raise _error("NVML_ERROR_TIMEOUT")
        index, xid = self._queue.pop(0)
        device = (
            pynvml.c_nvmlDevice_t(self._structs[index])
            if index is not None
            else pynvml.c_nvmlDevice_t()
        )
        return pynvml.c_nvmlEventData_t(
            device=device,
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        )
