"""planaria keeps large distributed training jobs running through faults."""

from importlib.metadata import PackageNotFoundError, version

from planaria.plugin import hookimpl

try:
    __version__ = version("planaria")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl"]
