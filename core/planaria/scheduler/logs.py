"""Where a node's agent writes its output: one file per node, private to the job's user.

Shared by every scheduler whose nodes can reach the job's ``log_dir`` (the local one, the
external one, Ray's actors), so that a node's log looks the same whichever started it.
"""

from __future__ import annotations

import os
from pathlib import Path


def open_node_log(log_dir: Path, node_id: str) -> int:
    """``<log_dir>/<node_id>.log``, 0600, appended: where a node's agent writes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{node_id}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also when the file existed, or the umask was unusual
    except OSError:
        os.close(fd)
        raise
    return fd
