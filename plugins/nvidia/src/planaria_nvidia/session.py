"""NVML for the life of the process, and the XID event set that must outlive each check.

NVML reports an XID to an event set only if the set was registered before the XID happened.
A check instance lives for one run, so the set lives here: created the first time a check runs
in this process (the agent, for the whole job), registered on every GPU once, and polled with
a 0 ms timeout by each later check, which therefore sees the XIDs raised since the previous one.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import pynvml

from planaria_nvidia.nvml import EventSet, Nvml, Pynvml

MAX_EVENTS_PER_POLL = 10_000
"""A bound on one poll: an event storm must not keep a check reading forever."""


@dataclass
class Xids:
    """The XIDs read in one poll, by GPU index (``None``: NVML named no device we know)."""

    by_device: dict[int | None, list[int]] = field(default_factory=lambda: defaultdict(list))
    truncated: bool = False


class NvmlSession:
    """Initialises NVML once and keeps the XID event set. Thread-safe: the check runner may
    start a new check while a timed-out one is still inside NVML."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._lock = threading.Lock()
        self._started = False
        self._event_set: EventSet | None = None
        self.xid_unsupported: dict[int, str] = {}
        """GPU index -> why XID events cannot be read there (registration refused)."""

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """``nvmlInit`` and the event set, the first time only. Raises ``pynvml.NVMLError``
        when NVML cannot start (no driver: ``NVMLError_LibraryNotFound``/``DriverNotLoaded``);
        the next call tries again, so a driver loaded later is picked up."""
        with self._lock:
            if self._started:
                return
            self.nvml.init()
            self._started = True
            self._register_xids()

    def _register_xids(self) -> None:
        try:
            event_set = self.nvml.event_set_create()
        except pynvml.NVMLError as exc:
            for index in range(self.nvml.device_get_count()):
                self.xid_unsupported[index] = f"no NVML event set: {exc}"
            return
        for index in range(self.nvml.device_get_count()):
            try:
                handle = self.nvml.device_get_handle_by_index(index)
                self.nvml.device_register_events(
                    handle, pynvml.nvmlEventTypeXidCriticalError, event_set
                )
            except pynvml.NVMLError as exc:
                self.xid_unsupported[index] = str(exc)
        self._event_set = event_set

    def poll_xids(self) -> Xids:
        """Every XID event waiting in the set, without ever blocking (timeout 0 ms)."""
        found = Xids()
        with self._lock:
            if self._event_set is None:
                return found
            for _ in range(MAX_EVENTS_PER_POLL):
                try:
                    event = self.nvml.event_set_wait(self._event_set, 0)
                except pynvml.NVMLError as exc:
                    if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                        return found  # nothing (more) waiting
                    raise
                if event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    found.by_device[self._index_of(event.device)].append(int(event.eventData))
            found.truncated = True
            return found

    def _index_of(self, handle: object) -> int | None:
        if not handle:  # a NULL device: an XID NVML could not attribute
            return None
        try:
            return self.nvml.device_get_index(handle)
        except pynvml.NVMLError:
            return None


_default: NvmlSession | None = None
_default_lock = threading.Lock()


def default_session() -> NvmlSession:
    """The process's session on the real NVML."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NvmlSession(Pynvml())
        return _default
