"""What a job keeps in files: the nodes found bad (so that later submissions of the job exclude
them) and the agents' logs."""

from __future__ import annotations

import os
from pathlib import Path

from planaria.log import get_logger

log = get_logger("scheduler.slurm")

BAD_NODES = "slurm-bad-nodes"
"""In the state directory: one line per bad node, ``<node> <why>``."""


def load(state_dir: Path | None) -> dict[str, str]:
    """The nodes remembered bad, with why; none when there is no state directory or file."""
    if state_dir is None:
        return {}
    try:
        text = (state_dir / BAD_NODES).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the bad nodes remembered", path=str(state_dir), error=str(exc))
        return {}
    nodes: dict[str, str] = {}
    for line in text.splitlines():
        name, _, why = line.strip().partition(" ")
        if name and not name.startswith("#"):
            nodes.setdefault(name, why.strip())
    return nodes


def remember(state_dir: Path | None, node: str, why: str) -> None:
    """Add ``node`` to the bad nodes (one appended line; a failure is a warning: the job goes
    on, only a later submission would not know)."""
    if state_dir is None or node in load(state_dir):
        return
    line = f"{node} {' '.join(why.split())}\n"
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(state_dir / BAD_NODES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot remember a bad node", node=node, path=str(state_dir), error=str(exc))


def open_log(log_dir: Path, node_id: str) -> int:
    """``<log_dir>/<node_id>.log``, 0600, appended: the srun's (and so the agent's) output."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(
        log_dir / f"{node_id}.log",
        os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o600,
    )
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd
