"""A scheduler whose nodes are simulated agents, for ``control_plane.py``.

It starts no process: ``launch`` hands out node ids (``node-0`` ... ``node-{N-1}``) and the
benchmark's asyncio clients register, join and heart-beat as those nodes over the real API.
A replacement is the next id in the same sequence (``node-N``, ``node-N+1`` ...), so the clients
know which agent to start without asking. The master loads it like any third-party scheduler,
through an entry point of the ``planaria`` group (the benchmark writes the ``dist-info`` that
declares it into a temporary directory on the master's path).
"""

from __future__ import annotations

import itertools
import threading

from pydantic import BaseModel, ConfigDict

import planaria
from planaria.plugin import SchedulerRecord
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeHandle, NodeState, Scheduler


class SimulatedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimulatedScheduler(Scheduler[SimulatedOptions]):
    name = "simulated"

    def __init__(self, options: SimulatedOptions) -> None:
        super().__init__(options)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._running: set[str] = set()

    def _node(self) -> NodeHandle:
        with self._lock:
            n = next(self._ids)
        node_id = f"node-{n}"
        self._running.add(node_id)
        return NodeHandle(node_id=node_id, host=f"sim-{n}", state=NodeState.RUNNING)

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        return [self._node() for _ in range(count)]

    def poll(self, timeout: float) -> list[NodeEvent]:
        return []  # a simulated node is lost by falling silent: the master's heartbeat watch

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        self._running.discard(node_id)
        return self._node()

    def stop(self, node_ids: list[str] | None = None) -> None:
        if node_ids is None:
            self._running.clear()
        else:
            self._running.difference_update(node_ids)


@planaria.hookimpl
def planaria_schedulers() -> list[SchedulerRecord]:
    return [
        SchedulerRecord(
            name="simulated",
            factory=SimulatedScheduler,
            options=SimulatedOptions,
            summary="node ids for the control-plane benchmark's simulated agents",
        )
    ]
