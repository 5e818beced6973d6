"""Whether a run directory may be resumed by this user: its journal holds the command the
agents run and the token they are trusted by, so whoever can rewrite the directory, the journal
or the token runs code as whoever resumes the job. Each must be this user's own and writable
by nobody else; a symbolic link or a file of another kind is refused too.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

from planaria.master.journal import JournalError


def check_private(run_dir: Path, names: Iterable[str]) -> None:
    """Raise :class:`JournalError` unless ``run_dir`` and each of its files ``names`` that
    exists is owned by this process's user and writable by neither group nor others."""
    uid = os.geteuid()
    try:
        _check(run_dir, os.stat(run_dir), uid, stat.S_ISDIR, "a directory")
    except OSError as exc:
        raise JournalError(f"cannot inspect {run_dir}: {exc.strerror or exc}") from None
    for name in names:
        path = run_dir / name
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise JournalError(f"cannot inspect {path}: {exc.strerror or exc}") from None
        _check(path, found, uid, stat.S_ISREG, "a regular file")


def _check(path: Path, found: os.stat_result, uid: int, kind: object, what: str) -> None:
    mode = found.st_mode
    if stat.S_ISLNK(mode):
        raise JournalError(
            f"{path} is a symbolic link: a master resumes only on the run's own files; "
            "refusing to resume"
        )
    if not kind(mode):  # type: ignore[operator]
        raise JournalError(f"{path} is not {what} ({stat.filemode(mode)}): refusing to resume")
    if found.st_uid != uid:
        raise JournalError(
            f"{path} is owned by {_user(found.st_uid)}, not by this user ({_user(uid)}): a "
            "master resumed on it would run what its owner wrote there; refusing to resume "
            "(resume the job as its owner)"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise JournalError(
            f"{path} is writable by {_writers(mode)} "
            f"(mode {stat.filemode(mode)}, 0o{stat.S_IMODE(mode):o}): anyone of them could "
            "rewrite what a resumed master runs; refusing to resume (if its content is "
            f"trusted: chmod go-w {path})"
        )


def _writers(mode: int) -> str:
    group, others = bool(mode & stat.S_IWGRP), bool(mode & stat.S_IWOTH)
    return "group and others" if group and others else "group" if group else "others"


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
