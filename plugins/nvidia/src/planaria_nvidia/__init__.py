"""planaria-nvidia: the ``nvidia`` health check, reading every GPU's health through NVML."""

from planaria_nvidia.check import NvidiaCheck
from planaria_nvidia.options import NvidiaOptions

__all__ = ["NvidiaCheck", "NvidiaOptions"]
