"""A run directory claimed by its master: the lock that keeps a second master off it while
one runs, and the job's token, kept there for a master that resumes the job (its agents trust
the token, so a resumed master needs the same one)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from planaria.master.journal import JournalError

TOKEN_FILE = "token"
LOCK_FILE = "master.lock"


def write_token(run_dir: Path, token: str) -> None:
    """The job's token, for a master resumed on this run directory (0600, like the rest)."""
    fd = os.open(run_dir / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)


def lock_run_dir(run_dir: Path) -> int:
    """Hold the run directory's master lock for this process's life: one master per run.
    Raises :class:`JournalError` when another master holds it."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise JournalError(
            f"a master (pid {holder}) is still running the job of {run_dir}: stop it first, "
            "or let it go on"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def read_token(run_dir: Path) -> str:
    path = run_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise JournalError(
            f"cannot read the job's token {path}: {why}; its agents are trusted by it, so the "
            "job cannot be resumed without it"
        ) from None
    if not token:
        raise JournalError(
            f"the job's token {path} is empty; its agents are trusted by it, so the job cannot "
            "be resumed without it"
        )
    return token
