"""Whether this machine has an NVIDIA driver that NVML can open."""

from __future__ import annotations

import pynvml


def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


DRIVER = _driver_present()
