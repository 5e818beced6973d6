"""Files in shared directories (/dev/shm), made so that another local user cannot subvert them.

/dev/shm is writable by everyone: a name there that another user can guess is a name they can
plant a symbolic link or a file of their own at, waiting for a process of ours (often root) to
open it. So every file planaria keeps there lives in a private directory: created exclusively
(``mkdir`` fails on anything already there, a link included), mode 0700, owned by us, and
checked after creation. Inside it nobody else can create, rename or remove an entry. Files in
it are still created with ``O_EXCL | O_NOFOLLOW`` and opened with ``O_NOFOLLOW`` and an owner
check, so that a mistake elsewhere cannot turn into a write through a link.

An existing entry that is not ours is an :class:`UnsafePathError`, never reused.

Every name starts with :func:`name_prefix`: ``planaria-``, or ``planaria-<tag>-`` where
``PLANARIA_SHM_TAG`` is set. The tag is how a test suite tells its own files from those of other
planaria jobs on the same machine: each test sets its own, every process it starts inherits it,
and the test checks for leftovers only among the names that carry it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from planaria.errors import PlanariaError

SHM_DIR = Path("/dev/shm")
PREFIX = "planaria-"
TAG_ENV = "PLANARIA_SHM_TAG"
"""A tag planaria puts in the name of everything it creates in /dev/shm (see the module's doc)."""
_TAG = re.compile(r"[A-Za-z0-9]{1,16}")
_NAME_MAX = 80
"""Longest directory name: a Unix socket's path inside it must stay under 108 bytes."""


class UnsafePathError(PlanariaError):
    """A path in a shared directory is not ours (another user's file, a link, wrong mode)."""


def name_prefix() -> str:
    """How every name planaria gives a file or directory in /dev/shm starts: ``planaria-``, or
    ``planaria-<tag>-`` with ``PLANARIA_SHM_TAG=<tag>`` in the environment."""
    tag = os.environ.get(TAG_ENV, "")
    if not tag:
        return PREFIX
    if not _TAG.fullmatch(tag):
        raise PlanariaError(
            f"{TAG_ENV}={tag!r} in the environment: a tag is 1 to 16 letters or digits"
        )
    return f"{PREFIX}{tag}-"


def node_dir(run_id: str, node_id: str, base: Path = SHM_DIR) -> Path:
    """The private directory of one node of one run: ``planaria-<run>-<node>`` (with the tag
    of :func:`name_prefix`), shortened with a digest when the names are long."""
    prefix = name_prefix()
    name = f"{prefix}{run_id}-{node_id}"
    if len(name) > _NAME_MAX:
        digest = hashlib.sha256(f"{run_id}\0{node_id}".encode()).hexdigest()[:16]
        name = f"{prefix}{run_id[:40]}-{digest}"
    return base / name


def _check_dir(path: Path) -> None:
    """``path`` is a real directory, ours, that nobody else may enter."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePathError(f"{path}: gone") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{path}: not a directory (a link or a file was put there)")
    if info.st_uid != os.geteuid():
        raise UnsafePathError(f"{path}: owned by uid {info.st_uid}, not by this user")
    if info.st_mode & 0o077:
        raise UnsafePathError(f"{path}: mode {stat.S_IMODE(info.st_mode):o}, not 0700")


def make_private_dir(path: Path) -> Path:
    """Create ``path`` as a fresh 0700 directory of ours; :class:`UnsafePathError` if anything
    is there already (whoever put it there, it is not to be trusted)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise UnsafePathError(
            f"{path} exists already and was not made by this process: refusing to use it "
            "(remove it if it is a leftover of yours)"
        ) from None
    os.chmod(path, 0o700, follow_symlinks=False)  # whatever the umask
    _check_dir(path)
    return path


def make_temp_dir(prefix: str, base: Path = SHM_DIR) -> Path:
    """A new private directory with an unpredictable name under ``base``."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))  # mode 0700, exclusive
    _check_dir(path)
    return path


def create_file(path: Path, flags: int = os.O_RDWR) -> int:
    """A new file (mode 0600) at ``path``; fails on anything already there, a link included."""
    _check_dir(path.parent)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def open_file(path: Path, flags: int = os.O_RDWR) -> int:
    """An existing regular file of ours, never through a link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symbolic link
            raise UnsafePathError(f"{path}: a symbolic link, not our file") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePathError(
            f"{path}: not a regular file of this user (uid {info.st_uid}): refusing to use it"
        )
    return fd


def remove_dir(path: Path) -> bool:
    """Remove a private directory of ours and everything in it; nothing else (a link or another
    user's directory at that name is left alone). Whether it was removed."""
    try:
        _check_dir(path)
    except UnsafePathError:
        return False
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)  # fd-based: it does not follow links inside
    return True
