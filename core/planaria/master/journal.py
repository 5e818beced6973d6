"""The master's journal: the job's state in SQLite in the run directory, so that a master
restarted on it (``planaria run --resume RUN_DIR``) picks the job up where the last one died.

What it keeps: what the job was started with (the config, the agents' job spec, the API's
address, the scheduler's node handles), and where it stands (the job's state, its rounds and
ranks, the restart budget spent, the faults and what became of them, the committed checkpoints,
every node's phase). Not the traffic: heartbeats and step counts are not decisions, and the
agents bring their own state back when they re-attach.

Each change is a transaction of its own, in WAL mode with ``synchronous=FULL``: once the
master has acted on a decision (answered an agent, asked the scheduler), it is on disk. The
master writes after every request it handled and every tick (:meth:`Journal.write`); only what
changed is written: nodes tell the journal when a field it keeps changes, the job-wide parts
are compared with what was written last.

A full disk must not turn a finished job into one that looks alive (and is resumed into a rerun),
so the end of a job does not depend on free space. The run directory keeps a **reserve**
(``journal.reserve``, :data:`RESERVE_BYTES` allocated at the start), given up to make room when
the journal's last write finds the disk full. And the end is also an **end mark**, made by
renaming an empty file made at the start (``job.running``) to ``job.ended-<state>``: a rename
needs neither a block nor an inode, so it succeeds on a full disk. A resume refuses a run with
an end mark, and ``planaria status`` believes the mark over a journal that says running.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_core import to_json

from planaria.errors import PlanariaError

if TYPE_CHECKING:
    from planaria.master.state import Node

NAME = "master.db"
SCHEMA = 1
RESERVE = "journal.reserve"
RESERVE_BYTES = 2 << 20
"""Room for the journal's last write (a few pages of SQLite, a WAL frame each)."""
RUNNING_MARK = "job.running"
ENDED_MARK = "job.ended-"


class JournalError(PlanariaError):
    """The run directory has no journal a master can resume from, or it cannot be read."""


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system has no room (SQLite's SQLITE_FULL, ENOSPC, EDQUOT)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == 13 or "disk is full" in str(exc)  # 13: SQLITE_FULL
    return False


def reserve_room(run_dir: Path, size: int = RESERVE_BYTES) -> bool:
    """Allocate the run directory's reserve (blocks on disk, not a sparse file), unless it is
    there; False when there is no room for it."""
    path = run_dir / RESERVE
    with contextlib.suppress(OSError):
        if path.stat().st_size >= size:
            return True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.pwrite(fd, bytes(size), 0)  # a file system without fallocate: write it
            os.fsync(fd)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)


def release_room(run_dir: Path) -> bool:
    """Give the reserve up (its blocks are free at once); whether there was one."""
    try:
        os.unlink(run_dir / RESERVE)
        return True
    except OSError:
        return False


def mark_running(run_dir: Path) -> None:
    """The empty file that :func:`mark_ended` renames: made while there is room."""
    with contextlib.suppress(FileExistsError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(run_dir / RUNNING_MARK, flags, 0o600))


def mark_ended(run_dir: Path, state: str) -> None:
    """Record that the job ended in ``state``, without needing free space (a rename); made
    as a new empty file when there is nothing to rename. Raises ``OSError`` if neither works."""
    target = run_dir / f"{ENDED_MARK}{state}"
    try:
        os.rename(run_dir / RUNNING_MARK, target)
    except FileNotFoundError:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(target, flags, 0o600))


def ended_mark(run_dir: Path) -> str | None:
    """The state the job's end mark records; None while it has none (running, or a master
    died before it ended)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return None
    for name in sorted(names):
        if name.startswith(ENDED_MARK) and len(name) > len(ENDED_MARK):
            return name[len(ENDED_MARK) :]
    return None


@dataclass(frozen=True)
class Journalled:
    """What a journal holds, read back."""

    meta: dict[str, Any]
    parts: dict[str, Any]
    nodes: dict[str, dict[str, Any]]
    handles: dict[str, dict[str, Any]]


class Journal:
    def __init__(self, path: Path, connection: sqlite3.Connection) -> None:
        self.path = path
        self._db = connection
        self._written: dict[str, str] = {}
        self._same: dict[str, Any] = {}
        self._dirty: set[str] = set()

    @classmethod
    def create(cls, run_dir: Path, meta: dict[str, Any]) -> Journal:
        path = run_dir / NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        mark_running(run_dir)
        reserve_room(run_dir)
        journal = cls(path, _connect(path))
        with journal._db:
            journal._db.executescript(
                """
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE parts (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE nodes (node_id TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE handles (node_id TEXT PRIMARY KEY, value TEXT NOT NULL);
                """
            )
            journal._db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in {**meta, "schema": SCHEMA}.items()],
            )
        return journal

    @classmethod
    def open(cls, run_dir: Path) -> tuple[Journal, Journalled]:
        """The journal of ``run_dir`` to go on writing (a resumed master), and what it holds."""
        path = existing(run_dir)
        db = None
        try:
            db = _connect(path)
            journalled = _read(db, path)
        except BaseException as exc:
            if db is not None:
                db.close()
            if isinstance(exc, sqlite3.Error):
                raise JournalError(f"cannot read the master journal {path}: {exc}") from None
            raise
        journal = cls(path, db)
        journal._written = {k: json.dumps(v, sort_keys=True) for k, v in journalled.parts.items()}
        return journal, journalled

    @staticmethod
    def read(run_dir: Path) -> Journalled:
        """What the journal of ``run_dir`` holds, read without writing anything (``planaria
        status``): so that a run on a read-only mount can be read, and a live master's
        journal is left alone."""
        path = existing(run_dir)
        uri = path.absolute().as_uri()
        try:
            return _read_uri(f"{uri}?mode=ro", path)
        except sqlite3.Error as exc:
            if not isinstance(exc, sqlite3.OperationalError) or os.access(path.parent, os.W_OK):
                raise JournalError(f"cannot read the master journal {path}: {exc}") from None
        # SQLite cannot make the WAL's index beside a journal in a directory it cannot write
        # (a read-only mount). Nothing writes the journal there either: read it as immutable.
        try:
            return _read_uri(f"{uri}?mode=ro&immutable=1", path)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot read the master journal {path}: {exc}") from None

    def keep_room(self) -> None:
        """Have the reserve (again) for a master that takes the job over: best effort."""
        reserve_room(self.path.parent)

    def set_meta(self, key: str, value: Any) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def node_changed(self, node_id: str) -> None:
        self._dirty.add(node_id)

    def write(
        self, parts: dict[str, Any], nodes: Mapping[str, Node], *, last: bool = False
    ) -> bool:
        """Write the parts that differ from what was written last, and the nodes that
        changed; whether anything was written. ``clock``: the time of the last write. A write
        that fails leaves its changes for the next one. ``last``: the job's final state,
        for which the reserve is given up when the disk is full."""
        changed = {}
        same = {}
        for key, value in parts.items():
            if self._same.get(key) is value:  # the very object written last: unchanged
                continue
            text = json.dumps(value, sort_keys=True)
            if self._written.get(key) != text:
                changed[key] = text
            same[key] = value
        dirty_ids = {n for n in self._dirty if n in nodes}
        # pydantic's encoder: a fifth of json.dumps's time, 10,000 rows at a restart.
        dirty = [(n, to_json(nodes[n].record()).decode()) for n in dirty_ids]
        if not changed and not dirty:
            self._same.update(same)
            self._dirty.clear()
            return False
        changed["clock"] = json.dumps(time.time())
        try:
            self._transaction(changed, dirty)
        except (sqlite3.Error, OSError) as exc:
            if not (last and disk_full(exc) and release_room(self.path.parent)):
                raise
            self._transaction(changed, dirty)  # in the room the reserve held
        self._same.update(same)
        self._dirty -= dirty_ids
        self._written.update(changed)
        return True

    def _transaction(self, changed: Mapping[str, str], dirty: list[tuple[str, str]]) -> None:
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO parts VALUES (?, ?)", changed.items())
            self._db.executemany("INSERT OR REPLACE INTO nodes VALUES (?, ?)", dirty)

    def handles(self, handles: list[dict[str, Any]]) -> None:
        """The scheduler's handles of new nodes (``node_id`` in each), in one transaction."""
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO handles VALUES (?, ?)",
                [(h["node_id"], json.dumps(h)) for h in handles],
            )

    def close(self) -> None:
        self._db.close()


def existing(run_dir: Path) -> Path:
    """The journal's path in ``run_dir``; raises :class:`JournalError` when it has none."""
    path = run_dir / NAME
    if not path.is_file():
        raise JournalError(
            f"{run_dir} holds no master journal ({NAME}): it is not a planaria run "
            "directory, or its job was started by a planaria without one"
        )
    return path


@contextmanager
def damaged(path: Path, where: str) -> Iterator[None]:
    """Restoring from ``where`` (a part of the journal at ``path``): what a missing key or a
    bad value raises becomes one :class:`JournalError` naming the file, the part and the key."""
    try:
        yield
    except KeyError as exc:
        key = exc.args[0] if exc.args else "?"
        raise JournalError(
            f"the master journal {path} is damaged: {where} has no {key!r}"
        ) from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        at = ".".join(map(str, first["loc"])) or "<value>"
        raise JournalError(
            f"the master journal {path} is damaged: {where}, {at}: {first['msg']}"
        ) from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise JournalError(f"the master journal {path} is damaged: {where}: {exc}") from None


def _read_uri(uri: str, path: Path) -> Journalled:
    db = sqlite3.connect(uri, uri=True)
    try:
        return _read(db, path)
    finally:
        db.close()


def _read(db: sqlite3.Connection, path: Path) -> Journalled:
    """What ``db`` holds (its ``sqlite3.Error`` are the caller's to say)."""
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        parts = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM parts")}
        nodes = {k: json.loads(v) for k, v in db.execute("SELECT node_id, value FROM nodes")}
        handles = {k: json.loads(v) for k, v in db.execute("SELECT node_id, value FROM handles")}
    except json.JSONDecodeError as exc:
        raise JournalError(f"cannot read the master journal {path}: {exc}") from None
    if meta.get("schema") != SCHEMA:
        raise JournalError(
            f"the master journal {path} has schema {meta.get('schema')!r}; this planaria "
            f"reads schema {SCHEMA}"
        )
    return Journalled(meta, parts, nodes, handles)


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)  # `with db:` is one transaction
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db
