"""A thread that reads what Slurm says about the job (its steps, its nodes' states) every
``watch_interval``, so that :meth:`SlurmScheduler.poll` never waits on a Slurm command.

Each look is two short commands (``squeue -s`` for the job, ``sinfo -N`` for its nodes);
their results replace the last snapshot, and a byte on a pipe wakes a poll waiting on it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from planaria.log import get_logger
from planaria.plugin import SchedulerError
from planaria_slurm import commands
from planaria_slurm.commands import NodeStatus

log = get_logger("scheduler.slurm")

# How soon to look again while a step started by us has not shown up in squeue yet.
_EAGER = 0.2


@dataclass(frozen=True)
class Snapshot:
    taken: float = 0.0
    steps: dict[str, str] = field(default_factory=dict)
    """Step name -> step id (``7.3``) of the job's live steps."""
    nodes: dict[str, NodeStatus] = field(default_factory=dict)
    error: str = ""
    """Why the last look failed (slurmctld unreachable ...); the snapshot before it is kept."""


class Watcher:
    def __init__(
        self,
        job_id: str,
        nodes: list[str],
        interval: float,
        eager: Callable[[], bool],
    ) -> None:
        self.job_id = job_id
        self.nodes = nodes
        self.interval = interval
        self._eager = eager
        """Whether a step we started is not seen yet: then look again soon."""
        self._lock = threading.Lock()
        self._snapshot = Snapshot()
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._loop, name="slurm-watch", daemon=True)
        self._thread.start()

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def nudge(self) -> None:
        """Look now (a step was just started)."""
        self._nudge.set()

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass

    def close(self) -> None:
        self._stop.set()
        self._nudge.set()
        self._thread.join(timeout=commands.TIMEOUT * 2 + 5)
        os.close(self.wake_fd)
        os.close(self._wake_w)

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                steps = commands.job_steps(self.job_id)
                nodes = commands.node_states(self.nodes)
            except SchedulerError as exc:
                if not failing:
                    log.warning("cannot read the job's state from Slurm", error=str(exc))
                failing = True
                with self._lock:
                    self._snapshot = Snapshot(
                        self._snapshot.taken, self._snapshot.steps, self._snapshot.nodes, str(exc)
                    )
            else:
                failing = False
                with self._lock:
                    self._snapshot = Snapshot(time.monotonic(), steps, nodes)
                # A full pipe means a wake-up is pending anyway.
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")
            wait = _EAGER if self._eager() else self.interval
            self._nudge.wait(wait)
            self._nudge.clear()
