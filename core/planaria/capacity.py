"""How many processes a machine can take: the workers its CPUs can train with, and the room
left in its process table.

A job asking more than a node has does not fail by itself with a reason: thousands of workers
fork until the machine thrashes and the agent stops heart-beating, and nothing names the cause.
The local scheduler (before launching, for the whole machine) and the agent (before starting
its workers) check a request against these bounds, and say which one it exceeds.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

WORKERS_PER_CPU = 8
"""More workers than this per CPU cannot train: each would get a sliver of a CPU."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; a container's cpuset shows there)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tasks_running() -> int | None:
    """Processes and threads on this machine now (the 4th field of /proc/loadavg: a/b)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None


def _user_tasks(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return count


def process_headroom() -> tuple[int, str] | None:
    """How many more processes this machine lets us start, and the limit that says so
    (``kernel.pid_max``, ``kernel.threads-max`` or ``RLIMIT_NPROC``); None where unknown."""
    running = _tasks_running()
    limits: list[tuple[int, str]] = []
    if running is not None:
        for name, path in (("kernel.pid_max", "pid_max"), ("kernel.threads-max", "threads-max")):
            limit = _read_int(f"/proc/sys/kernel/{path}")
            if limit is not None:
                limits.append((limit - running, f"{name} = {limit}, {running} in use"))
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to it
        used = _user_tasks(os.getuid())
        limits.append((soft - used, f"RLIMIT_NPROC (ulimit -u) = {soft}, {used} in use"))
    if not limits:
        return None
    room, why = min(limits)
    return max(room, 0), why


def shortfall(workers: int, processes: int) -> str | None:
    """Why this machine cannot run ``workers`` worker processes (``processes`` in all, with
    the ones that look after them); None when it can."""
    cpus = usable_cpus()
    if workers > WORKERS_PER_CPU * cpus:
        return (
            f"{workers} workers are more than this machine can train with: it has {cpus} "
            f"CPU(s), and more than {WORKERS_PER_CPU} workers per CPU each get a sliver of one"
        )
    headroom = process_headroom()
    if headroom is not None and processes > headroom[0]:
        room, why = headroom
        return (
            f"{processes} processes do not fit in this machine's process table: there is room "
            f"for {room} more ({why})"
        )
    return None
