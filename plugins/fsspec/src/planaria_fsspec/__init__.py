"""planaria-fsspec: checkpoint storage on any fsspec URL (S3, GCS, Azure, a file system ...)."""

from planaria_fsspec.options import FsspecStorageOptions
from planaria_fsspec.storage import FsspecStorage

__all__ = ["FsspecStorage", "FsspecStorageOptions"]
