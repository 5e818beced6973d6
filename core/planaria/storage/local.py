"""The ``local`` checkpoint storage: a directory on this machine (or a mounted file system).

Keys map to paths under :attr:`LocalStorageOptions.path`. An object is written to a temporary
file in its final directory (mode 0600), fsynced, renamed into place and its directory fsynced,
so a crash leaves either the old object or the new one, never a torn one. Directories are created
0700. A step is committed by renaming its ``*.partial`` directory, after fsyncing everything under
it; the rename refuses to replace an existing step (``renameat2(RENAME_NOREPLACE)`` where the
kernel and file system support it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from planaria.errors import StorageError
from planaria.plugin import hookimpl
from planaria.storage.api import CheckpointStorage, CheckpointStorageRecord, split_key

_TMP_PREFIX = ".planaria-tmp-"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


class LocalStorageOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(default=Path("checkpoints"), description="directory holding the checkpoints")
    fsync: bool = Field(
        default=True, description="fsync files and directories (turn off only for tests)"
    )


def _fsync_path(path: Path, *, directory: bool) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; :class:`FileExistsError` if ``dst`` exists."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is not None:
            result = renameat2(
                _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
            )
            if result == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), str(src), None, str(dst))
    # No atomic no-replace rename here: check, then rename (os.rename still refuses a
    # non-empty destination directory).
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


class LocalStorage(CheckpointStorage[LocalStorageOptions]):
    """Checkpoints in a directory."""

    name = "local"

    def __init__(self, options: LocalStorageOptions) -> None:
        super().__init__(options)
        self.root = options.path.expanduser().absolute()

    # -- helpers -------------------------------------------------------------------------------

    def _path(self, key: str, *, allow_root: bool = False) -> Path:
        return self.root.joinpath(*split_key(key, allow_root=allow_root))

    def _fsync_dir(self, path: Path) -> None:
        if self.options.fsync:
            _fsync_path(path, directory=True)

    def _makedirs(self, path: Path) -> None:
        """Create ``path`` and its missing parents under the root, 0700, durably."""
        if not self.root.is_dir():
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir(mode=0o700)
                os.chmod(self.root, 0o700)
                self._fsync_dir(self.root.parent)
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                current.mkdir(mode=0o700)
            except FileExistsError:
                continue
            os.chmod(current, 0o700)
            self._fsync_dir(current.parent)

    def _fsync_tree(self, path: Path) -> None:
        if not self.options.fsync:
            return
        if not path.is_dir():
            _fsync_path(path, directory=False)
            return
        for dirpath, _dirnames, filenames in os.walk(path):
            for filename in filenames:
                _fsync_path(Path(dirpath, filename), directory=False)
            _fsync_path(Path(dirpath), directory=True)

    # -- the interface -------------------------------------------------------------------------

    def write(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        path = self._path(key)
        try:
            self._makedirs(path.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)  # mode 0600
        except OSError as exc:
            raise StorageError(f"cannot write {key!r} under {self.root}: {exc}") from exc
        written = 0
        try:
            with os.fdopen(fd, "wb") as file:
                for chunk in chunks:
                    written += file.write(chunk)
                file.flush()
                if self.options.fsync:
                    os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise StorageError(f"cannot write {key!r} to {path}: {exc}") from exc
            raise
        try:
            self._fsync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"cannot make {key!r} durable in {path.parent}: {exc}") from exc
        return written

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(key)
        if offset < 0 or (length is not None and length < 0):
            raise StorageError(
                f"invalid range for {key!r}: offset {offset}, length {length} (both must be >= 0)"
            )
        with open(path, "rb") as file:
            if offset:
                file.seek(offset)
            return file.read() if length is None else file.read(length)

    def size(self, key: str) -> int:
        path = self._path(key)
        st = os.stat(path)
        if not os.path.isfile(path):
            raise IsADirectoryError(errno.EISDIR, f"{key!r} is a prefix, not an object", path)
        return st.st_size

    def list(self, prefix: str = "") -> list[str]:
        path = self._path(prefix.rstrip("/"), allow_root=True)
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(name for name in names if not name.startswith(_TMP_PREFIX))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {key!r} ({path}): {exc}") from exc
        with contextlib.suppress(FileNotFoundError):
            self._fsync_dir(path.parent)

    def commit(self, partial: str, final: str) -> None:
        src, dst = self._path(partial), self._path(final)
        if not src.exists():
            raise StorageError(f"cannot commit {partial!r}: it does not exist")
        if os.path.lexists(dst):
            raise StorageError(f"cannot commit {partial!r} as {final!r}: {final!r} already exists")
        try:
            self._fsync_tree(src)
            self._makedirs(dst.parent)
            _rename_noreplace(src, dst)
        except FileExistsError as exc:
            raise StorageError(
                f"cannot commit {partial!r} as {final!r}: {final!r} already exists"
            ) from exc
        except OSError as exc:
            raise StorageError(f"cannot commit {partial!r} as {final!r}: {exc}") from exc
        try:
            self._fsync_dir(dst.parent)
            if src.parent != dst.parent:
                self._fsync_dir(src.parent)
        except OSError as exc:
            raise StorageError(f"cannot make commit of {final!r} durable: {exc}") from exc


@hookimpl
def planaria_checkpoint_storages() -> Iterator[CheckpointStorageRecord]:
    yield CheckpointStorageRecord(
        name="local",
        factory=LocalStorage,
        options=LocalStorageOptions,
        summary="checkpoints in a local (or mounted) directory; atomic rename commits",
    )
