"""The ``external`` scheduler: nodes started outside planaria, the way torchrun's are.

``srun planaria run --rdzv-endpoint HOST:PORT ...`` (or mpirun, pdsh, a Kubernetes Indexed
Job) starts one launcher per node; whoever started them owns them. The launcher on the
endpoint's host runs the master, which uses this scheduler, and starts this node's agent
(``here``); every other launcher runs its agent itself, and the agent registers with the
master under its own node id. So the scheduler starts nothing but the one agent here, and
replaces nothing:

- :meth:`ExternalScheduler.admit` lets a node the master never launched register, up to the
  job's ``max`` nodes: the fleet asks it for every unknown id (:class:`AdmitsNodes`).
- A lost node is not replaced, it is waited for: :meth:`ExternalScheduler.replace` keeps its
  slot open under the same id, so the same launcher coming back (``srun --requeue``, a
  restarted pod) registers into it. Meanwhile the rendezvous forms without it: an elastic job
  (``--nnodes MIN:MAX``) shrinks after ``rendezvous.join_grace`` and grows again when the node
  is back; a job below ``MIN`` fails after ``rendezvous.join_timeout``.
- :meth:`ExternalScheduler.stop` ends only the agent here; the other launchers end when
  their agents hear that the job is over (or that the master is gone, after its grace).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from planaria import process
from planaria.errors import SchedulerError
from planaria.log import get_logger
from planaria.plugin import hookimpl
from planaria.scheduler.api import (
    AdmitsNodes,
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    Scheduler,
    SchedulerRecord,
)
from planaria.scheduler.logs import open_node_log

log = get_logger("scheduler")

STOP_GRACE = 10.0
"""Seconds from SIGTERM to SIGKILL for the agent here (its workers get the job's own grace
from the agent first)."""


class ExternalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    here: str | None = Field(
        default=None,
        description="node id of an agent to start on this machine (the master's own node, "
        "when the master's launcher is one of the nodes); none: start nothing",
    )
    host: str = Field(default="", description="this machine's name for the agent here")


class ExternalScheduler(Scheduler[ExternalOptions], AdmitsNodes):
    """Nodes started outside planaria; see the module's docstring."""

    name = "external"

    def __init__(self, options: ExternalOptions) -> None:
        super().__init__(options)
        self._lock = threading.Lock()  # admit() comes from the master's loop
        self._capacity = 0
        self._nodes: dict[str, str] = {}
        """Node id -> host: every node in the job, those waited for included."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._events: list[NodeEvent] = []
        self._reported = False

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        self.check_interrupted("cannot launch")
        with self._lock:
            self._capacity = count
        here = self.options.here
        if here is None:
            return []
        host = self.options.host or os.uname().nodename
        env = {**os.environ, **spec.env, "PLANARIA_NODE_ID": here, "PLANARIA_HOST": host}
        log_fd = None if spec.log_dir is None else open_node_log(spec.log_dir, here)
        try:
            self._proc = process.popen(
                spec.command, env=env, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd
            )
        except OSError as exc:
            raise SchedulerError(
                f"cannot start this node's agent ({spec.command[0]}): {exc}"
            ) from exc
        finally:
            if log_fd is not None:
                os.close(log_fd)
        with self._lock:
            self._nodes[here] = host
        return [NodeHandle(node_id=here, host=host, data={"pid": str(self._proc.pid)})]

    def admit(self, node_id: str, host: str) -> NodeHandle:
        with self._lock:
            if node_id not in self._nodes and len(self._nodes) >= self._capacity:
                raise SchedulerError(
                    f"the job has its {self._capacity} node(s) already (--nnodes, job.nodes): "
                    f"{', '.join(sorted(self._nodes))}"
                )
            self._nodes[node_id] = host
        log.info("node admitted", node=node_id, host=host)
        return NodeHandle(node_id=node_id, host=host, state=NodeState.RUNNING)

    def poll(self, timeout: float) -> list[NodeEvent]:
        proc = self._proc
        if proc is not None and not self._reported and proc.poll() is not None:
            self._reported = True
            state = NodeState.SUCCEEDED if proc.returncode == 0 else NodeState.FAILED
            reason = f"this node's agent exited with {proc.returncode}"
            self._events.append(
                NodeEvent(node_id=self.options.here or "", state=state, reason=reason)
            )
        events, self._events = self._events, []
        if not events and timeout > 0:
            self._interrupted.wait(timeout)
        return events

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Start nothing: keep the node's slot open for its launcher to come back. A node
        diagnosed bad is taken out for good: only its launcher's starter can move it."""
        self.check_interrupted(f"cannot wait for {node_id}")
        with self._lock:
            host = self._nodes.get(node_id)
            if host is None:
                raise SchedulerError(f"unknown node {node_id!r}")
            if exclude_host or node_id == self.options.here:
                del self._nodes[node_id]
                why = (
                    "it is this launcher's own node"
                    if node_id == self.options.here
                    else f"its host {host} was diagnosed bad"
                )
                raise SchedulerError(
                    f"nodes are started outside planaria (scheduler external) and {node_id} "
                    f"cannot come back: {why}"
                )
        log.info("waiting for a lost node to come back", node=node_id, host=host)
        return NodeHandle(node_id=node_id, host=host, state=NodeState.PENDING)

    def stop(self, node_ids: list[str] | None = None) -> None:
        with self._lock:
            for node_id in self._nodes.copy() if node_ids is None else node_ids:
                self._nodes.pop(node_id, None)
        here = self.options.here
        if self._proc is not None and (node_ids is None or here in node_ids):
            if self._proc.poll() is None:
                process.kill_group(self._proc.pid, STOP_GRACE)
            self._proc.wait()


@hookimpl
def planaria_schedulers() -> Iterable[SchedulerRecord]:
    yield SchedulerRecord(
        name="external",
        factory=ExternalScheduler,
        options=ExternalOptions,
        summary="nodes started outside planaria (srun, mpirun, an Indexed Job), torchrun's way",
    )
