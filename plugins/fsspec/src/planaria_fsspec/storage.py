"""The ``fsspec`` checkpoint storage: checkpoints on any fsspec URL.

Object stores (``s3://``, ``gs://``, ``az://``) have no rename, so a step is committed without
one: the objects of ``step-N.partial/`` are copied (server side) under ``step-N/`` while a
*pending marker* ``.planaria-pending.step-N`` sits beside it; deleting the marker is the commit
point. Readers treat a prefix whose marker exists, and everything under it, as absent, so they
see the whole step or nothing, even if the committing process dies half way. A prefix is
deleted the same way (marker, objects, marker), so it never shows half deleted.

Writes are streamed in parts of ``part_size`` and are visible only once complete: on object
stores an upload becomes an object when it completes; elsewhere (``memory://``, ``sftp://``,
``hdfs://``) the object is written under a temporary name and renamed into place. On
``file://`` the storage is the built-in ``local`` storage (fsync, 0600 files, atomic rename).
See the plugin's README for the whole design.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from planaria.errors import StorageError
from planaria.plugin import CheckpointStorage
from planaria.storage.local import LocalStorage, LocalStorageOptions
from planaria_fsspec.keys import RESERVED, split_key
from planaria_fsspec.options import FsspecStorageOptions
from planaria_fsspec.retry import Retrier, is_transient, log

T = TypeVar("T")

PENDING = RESERVED + "pending."
TMP = RESERVED + "tmp-"

# Stores where an upload becomes visible only when complete (multipart upload, block list):
# objects are written in place. Any other file system writes a temporary object and renames it.
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})

_COPY_WORKERS = 8


class _ProducerFailed(Exception):
    """The caller's chunks raised ``error``: it is theirs, re-raised as it is, never retried."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _protocols(fs: AbstractFileSystem) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _byte_view(chunk: bytes | memoryview) -> memoryview:
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class FsspecStorage(CheckpointStorage[FsspecStorageOptions]):
    """Checkpoints under an fsspec URL; see the module docstring for the commit protocol."""

    name = "fsspec"

    def __init__(self, options: FsspecStorageOptions) -> None:
        super().__init__(options)
        self.url = options.url
        self._retry = Retrier(options.retries, options.retry_backoff, options.retry_backoff_max)
        # Listings must never come from a cache: another process commits and deletes steps.
        kwargs: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        kwargs.update(options.storage_options)
        try:
            fs, root = url_to_fs(options.url, **kwargs)
        except (ImportError, TypeError, ValueError) as exc:
            raise StorageError(f"cannot open checkpoint storage {options.url}: {exc}") from exc
        self.fs: AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or "/"
        self._local = (
            LocalStorage(LocalStorageOptions(path=Path(self.root)))
            if isinstance(fs, LocalFileSystem)
            else None
        )
        self._atomic_put = bool(_protocols(fs) & ATOMIC_PUT_PROTOCOLS)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # -- paths and markers ---------------------------------------------------------------------

    def _path(self, parts: list[str]) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def _marker(self, parts: list[str]) -> str:
        return self._path([*parts[:-1], PENDING + parts[-1]])

    def _hidden(self, parts: list[str]) -> bool:
        """Whether the key ``parts`` or one of its prefixes is being committed or deleted."""
        markers = [self._marker(parts[: depth + 1]) for depth in range(len(parts))]
        found = self.fs.cat(markers, on_error="return")
        for value in found.values():
            if isinstance(value, FileNotFoundError):
                continue
            if isinstance(value, BaseException):
                raise value
            return True
        return False

    def _marker_exists(self, marker: str) -> bool:
        try:
            self.fs.cat_file(marker)
        except FileNotFoundError:
            return False
        return True

    def _under(self, path: str, *, withdirs: bool = False) -> list[str]:
        """Everything strictly under the prefix ``path`` (never ``path`` itself, nor a sibling
        that merely starts with the same characters)."""
        try:
            found = self.fs.find(path, withdirs=withdirs)
        except (FileNotFoundError, NotADirectoryError):
            return []
        head = path.rstrip("/") + "/"
        return sorted(p for p in found if p.startswith(head))

    def _is_file(self, path: str) -> bool:
        try:
            return bool(self.fs.info(path).get("type") == "file")
        except FileNotFoundError:
            return False

    # -- running operations --------------------------------------------------------------------

    def _run(
        self,
        verb: str,
        key: str,
        operation: Callable[[], T],
        *,
        absent_ok: bool = False,
        retries: int | None = None,
        why_no_retry: str = "",
    ) -> T:
        """Run ``operation`` with retries; errors other than an absent key (when ``absent_ok``)
        become :class:`StorageError` naming the object's URL."""
        where = f"{self.url}/{key}" if key else self.url
        try:
            return self._retry.call(f"{verb} {where}", operation, retries=retries)
        except (FileNotFoundError, IsADirectoryError) as exc:
            if absent_ok:
                raise
            raise StorageError(
                f"cannot {verb} {where}: {type(exc).__name__}: {exc} (does the bucket, "
                "container or directory exist?)"
            ) from exc
        except StorageError:
            raise
        except _ProducerFailed as failed:
            raise failed.error from None
        except PermissionError as exc:
            raise StorageError(f"cannot {verb} {where}: permission denied: {exc}") from exc
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if is_transient(exc):
                limit = self._retry.retries if retries is None else retries
                tail = f"; gave up after {limit} retries" if limit else "; not retried"
                detail += f" (a transient error{tail}{why_no_retry})"
            raise StorageError(f"cannot {verb} {where}: {detail}") from exc

    # -- the interface -------------------------------------------------------------------------

    def write(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        if self._local is not None:
            return self._local.write(key, chunks)
        path = self._path(split_key(key))
        source, replayable = self._replayable(chunks)
        return self._run(
            "write",
            key,
            lambda: self._upload(path, source),
            retries=None if replayable else 0,
            why_no_retry=""
            if replayable
            else ": the data came from a one-shot iterator "
            "larger than part_size and cannot be sent again",
        )

    def _replayable(
        self, chunks: Iterable[bytes | memoryview]
    ) -> tuple[Iterable[bytes | memoryview], bool]:
        """The chunks in a form that can be sent again after a transient error, when possible.

        A collection (a list of buffers) can be; a one-shot iterator is read ahead by up to one
        part: if it ends there, the object is small and kept whole for retries; if not, it is
        streamed once, never held in memory whole.
        """
        if isinstance(chunks, Collection) and not isinstance(chunks, Iterator):
            return chunks, True
        iterator = iter(chunks)
        head: list[bytes | memoryview] = []
        size = 0
        for chunk in iterator:
            data = bytes(chunk)  # the producer may reuse its buffer once it yields the next one
            head.append(data)
            size += len(data)
            if size > self.options.part_size:
                return itertools.chain(head, iterator), False
        return head, True

    def _upload(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        if self._atomic_put:
            target = path
        else:
            parent = path.rsplit("/", 1)[0]
            target = f"{parent}/{TMP}{uuid.uuid4().hex}"
            self.fs.makedirs(parent, exist_ok=True)
        file = self.fs.open(target, "wb", block_size=int(self.options.part_size))
        written = 0
        iterator = iter(chunks)
        try:
            while True:
                try:
                    chunk = next(iterator)
                except StopIteration:
                    break
                except Exception as exc:
                    raise _ProducerFailed(exc) from None
                view = _byte_view(chunk)
                if view.nbytes:
                    file.write(view)
                    written += view.nbytes
            file.close()  # completes the upload: durable once it returns
        except BaseException:
            self._abandon(file, target)
            raise
        if target != path:
            try:
                self.fs.mv(target, path)
            except BaseException:
                with suppress(Exception):
                    self.fs.rm_file(target)
                raise
        return written

    def _abandon(self, file: Any, target: str) -> None:
        """Throw away an upload that failed: it must never complete into a torn object."""
        with suppress(Exception):
            file.discard()  # aborts a multipart upload
        with suppress(Exception):
            file.closed = True  # so that garbage collection does not close (complete) it
        if not self._atomic_put:
            with suppress(Exception):
                self.fs.rm_file(target)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if self._local is not None:
            return self._local.read(key, offset, length)
        parts = split_key(key)
        if offset < 0 or (length is not None and length < 0):
            raise StorageError(
                f"invalid range for {key!r}: offset {offset}, length {length} (both must be >= 0)"
            )
        path = self._path(parts)

        def read() -> bytes:
            if offset == 0 and length is None:
                data = bytes(self.fs.cat_file(path))
            else:
                # A range past the end is an error on object stores: clamp it to the size.
                size = self._object_size(path)
                start = min(offset, size)
                end = size if length is None else min(size, offset + length)
                data = bytes(self.fs.cat_file(path, start=start, end=end)) if end > start else b""
            # Checked after reading: if no marker exists now, the data read was committed.
            if self._hidden(parts):
                raise FileNotFoundError(f"{self.url}/{key} is not committed")
            return data

        return self._run("read", key, read, absent_ok=True)

    def _object_size(self, path: str) -> int:
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise IsADirectoryError(f"{path} is a prefix, not an object")
        return int(info["size"])

    def size(self, key: str) -> int:
        if self._local is not None:
            return self._local.size(key)
        parts = split_key(key)
        path = self._path(parts)

        def size() -> int:
            result = self._object_size(path)
            if self._hidden(parts):
                raise FileNotFoundError(f"{self.url}/{key} is not committed")
            return result

        return self._run("size", key, size, absent_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        if self._local is not None:
            return self._local.list(prefix)
        parts = split_key(prefix.rstrip("/"), allow_root=True)
        path = self._path(parts).rstrip("/")

        def list_() -> list[str]:
            try:
                entries = self.fs.ls(path, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
            names: set[str] = set()
            for entry in entries:
                name = str(entry["name"]).rstrip("/")
                if name.startswith(path + "/"):  # not the prefix itself when it is an object
                    names.add(name[len(path) + 1 :].split("/", 1)[0])
            pending = {name[len(PENDING) :] for name in names if name.startswith(PENDING)}
            visible = sorted(n for n in names if not n.startswith(RESERVED) and n not in pending)
            if visible and parts and self._hidden(parts):
                return []
            return visible

        return self._run("list", prefix, list_)

    def delete(self, key: str) -> None:
        if self._local is not None:
            self._local.delete(key)
            return
        parts = split_key(key)
        path, marker = self._path(parts), self._marker(parts)

        def delete() -> None:
            stale_marker = self._marker_exists(marker)
            if self._under(path, withdirs=True):
                # Hide the prefix first, so that no reader sees it half deleted.
                self.fs.pipe_file(marker, b"delete\n")
                self.fs.rm(path, recursive=True)
                self.fs.rm_file(marker)
                return
            with suppress(FileNotFoundError):
                self.fs.rm_file(path)
            if stale_marker:
                self.fs.rm_file(marker)

        self._run("delete", key, delete)

    def commit(self, partial: str, final: str) -> None:
        if self._local is not None:
            self._local.commit(partial, final)
            return
        src_parts, dst_parts = split_key(partial), split_key(final)
        shorter = min(len(src_parts), len(dst_parts))
        if src_parts[:shorter] == dst_parts[:shorter]:
            raise StorageError(f"cannot commit {partial!r} as {final!r}: one contains the other")
        src, dst, marker = self._path(src_parts), self._path(dst_parts), self._marker(dst_parts)

        def sources() -> list[str]:
            found = [p for p in self._under(src) if not p.rsplit("/", 1)[-1].startswith(TMP)]
            return found or ([src] if self._is_file(src) else [])

        objects = self._run("commit", partial, sources)
        if not objects:
            raise StorageError(f"cannot commit {partial!r}: it does not exist")
        # A marker left by a commit or delete that died half way: its objects were never
        # visible, and are replaced.
        stale = self._run("commit", final, lambda: self._marker_exists(marker))
        if not stale and self._run("commit", final, lambda: self.fs.exists(dst)):
            raise StorageError(f"cannot commit {partial!r} as {final!r}: {final!r} already exists")
        self._run("commit", final, lambda: self.fs.pipe_file(marker, b"commit\n"))
        if stale:
            self._run("commit", final, lambda: self._remove_tree(dst))

        def copy(source: str) -> None:
            target = dst + source[len(src) :]
            self._run("commit", final, lambda: self.fs.cp_file(source, target))

        with ThreadPoolExecutor(max_workers=min(_COPY_WORKERS, len(objects))) as pool:
            list(pool.map(copy, objects))
        self._run("commit", final, lambda: self.fs.rm_file(marker))  # the commit point
        try:
            self._run("clean up", partial, lambda: self._remove_tree(src))
        except StorageError as exc:
            log.warning("step committed, but its partial copy was not removed", error=str(exc))

    def _remove_tree(self, path: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
