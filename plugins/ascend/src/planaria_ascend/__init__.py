"""planaria-ascend: the ``ascend`` health check, for Huawei Ascend NPUs."""

from planaria_ascend.check import AscendCheck
from planaria_ascend.options import AscendOptions

__all__ = ["AscendCheck", "AscendOptions"]
