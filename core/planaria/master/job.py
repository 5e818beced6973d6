"""The master's job logic: nodes, rounds, restart budget and fault policy.

All state lives on one asyncio loop, so handlers and the ticker never race. Scheduler calls
run on one dedicated thread (a local scheduler's child processes are tied to the thread that
started them), never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from planaria.diagnosis.messages import HangReport, HealthReport
from planaria.diagnosis.policy import DiagnosisPolicy
from planaria.errors import SchedulerError
from planaria.events import EventKind, JobEvent
from planaria.log import get_logger
from planaria.master.checkpoints import JobCheckpoints
from planaria.master.diagnosis import Diagnosis
from planaria.master.preflight import Preflight
from planaria.master.restore import agree
from planaria.master.rounds import Rounds
from planaria.master.timeline import Fault, Summary, Timeline
from planaria.protocol import (
    Action,
    ChaosReport,
    CheckpointEvent,
    Heartbeat,
    JobSpec,
    JobStatus,
    JoinReply,
    JoinRequest,
    MemoryHolding,
    NodeStatus,
    RegisterRequest,
    RoundDirectives,
    WorkerFailure,
    WorkersReport,
)
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeState, Scheduler

log = get_logger("master")

TICK = 0.05


class BadReport(ValueError):
    """A request that is well-formed but makes no sense for the job."""


class RegistrationRefused(PermissionError):
    """A registration the master will not accept: a node id it never launched, or a second
    agent claiming a node that is already registered. ``retry``: the id may still come (a
    launch is in flight), so the agent should ask again shortly."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class JobState(str, Enum):
    STARTING = "starting"
    PREFLIGHT = "preflight"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


class NodePhase(str, Enum):
    LAUNCHED = "launched"
    REGISTERED = "registered"
    PREFLIGHT = "preflight"
    JOINED = "joined"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STANDBY = "standby"
    LOST = "lost"
    EXITED = "exited"

    @property
    def gone(self) -> bool:
        return self in (NodePhase.LOST, NodePhase.EXITED)


@dataclass
class Node:
    node_id: str
    host: str
    phase: NodePhase = NodePhase.LAUNCHED
    addr: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    """When the master last heard from the node, on the monotonic clock (a wall-clock step
    must not make every node look silent)."""
    pid: int | None = None
    action: Action | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    step: int = -1
    memory: list[MemoryHolding] = field(default_factory=list)

    def send(self, action: Action) -> None:
        self.action = action
        self.wake.set()


@dataclass(frozen=True)
class JobSettings:
    spec: JobSpec
    min_nodes: int
    max_nodes: int
    node_unit: int
    join_grace: float
    join_timeout: float
    diagnosis: DiagnosisPolicy = field(default_factory=DiagnosisPolicy)


class Master:
    def __init__(
        self,
        settings: JobSettings,
        scheduler: Scheduler[Any],
        run_dir: Path,
        observer: Any = None,
    ) -> None:
        self.settings = settings
        self.spec = settings.spec
        self.scheduler = scheduler
        self.run_dir = run_dir
        self.state = JobState.STARTING
        self.reason = ""
        self.restarts = 0
        self.nodes: dict[str, Node] = {}
        self.faults: list[Fault] = []
        self.rounds = Rounds(
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            node_unit=settings.node_unit,
            join_grace=settings.join_grace,
            procs_per_node=self.spec.procs_per_node,
        )
        self.timeline = Timeline(run_dir / "events.jsonl", self.spec.job, observer or _ignore)
        self.started = time.time()
        self.first_step_at: float | None = None
        self.finished_at: float | None = None
        self._round_settled = asyncio.Event()
        """Set when the forming round closes, is superseded or the job ends."""
        self.restore = "storage"
        """Where this round's workers restore from: ``memory:<step>`` or ``storage``."""
        self.persist_step: int | None = None
        self.checkpoints = JobCheckpoints(self.spec.checkpoint, self.timeline)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")
        self._tasks: set[asyncio.Task[None]] = set()
        self._launching = 0
        """Scheduler calls in flight that may start agents (launch, replace)."""
        self.diagnosis = Diagnosis(self, settings.diagnosis)
        self.preflight = Preflight(self, settings.diagnosis.preflight)

    # -- scheduler ------------------------------------------------------------------------

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def launch(self, spec: LaunchSpec) -> None:
        self._launching += 1
        try:
            handles = await self._call(self.scheduler.launch, spec, self.settings.max_nodes)
        except SchedulerError:
            if not self.state.terminal:
                raise
            handles = []  # stopped while launching: the scheduler released what it started
        finally:
            self._launching -= 1
        for handle in handles:
            self.nodes[handle.node_id] = Node(handle.node_id, handle.host)
        if self.state.terminal:  # stopped meanwhile (a signal): the job must not start again
            return
        if self.preflight.finished:
            self._open_round()
        else:  # the first round opens once the pre-flight check is done
            self.state = JobState.PREFLIGHT
        self.timeline.emit(
            EventKind.JOB_STARTED,
            f"job {self.spec.job} started: {len(handles)} node(s) requested",
            run_id=self.spec.run_id,
            nodes=[h.node_id for h in handles],
        )

    def _on_node_event(self, event: NodeEvent) -> None:
        node = self.nodes.get(event.node_id)
        if node is None or node.phase.gone:
            return
        if event.state in (NodeState.PENDING, NodeState.RUNNING):
            return
        if self.state.terminal:
            node.phase = NodePhase.EXITED
            return
        reason = event.reason or event.state.value
        self._node_lost(node, f"agent process ended: {reason}")

    # -- handlers (called by the HTTP server) ----------------------------------------------

    def register(self, request: RegisterRequest) -> JobSpec:
        """Accept an agent for a node this job launched, once. The token alone does not make
        a node: an id the scheduler never reported is refused (while a launch is in flight,
        with "ask again": its agent may be faster than the scheduler's answer), and so is a
        second agent for a registered node. Every refusal is in the timeline."""
        node = self.nodes.get(request.node_id)
        if node is None:
            if self._launching or self.replacing():
                raise RegistrationRefused(
                    f"node {request.node_id!r} is not known yet; ask again", retry=True
                )
            self._refuse(request, "this job never launched a node of that id")
        elif node.phase.gone:
            self._refuse(request, f"the node is {node.phase.value}: it is out of the job")
        elif node.phase is not NodePhase.LAUNCHED:
            if (node.pid, node.host, node.addr) == (request.pid, request.host, request.addr):
                node.last_seen = time.monotonic()  # the same agent asking again: its reply
                return self.spec  # was lost on the way
            self._refuse(
                request,
                f"the node is registered already (agent pid {node.pid} on {node.host})",
            )
        assert node is not None
        node.addr = request.addr
        node.pid = request.pid
        node.phase = NodePhase.REGISTERED
        node.last_seen = time.monotonic()
        log.info("node registered", node=request.node_id, host=request.host, pid=request.pid)
        return self.spec

    def _refuse(self, request: RegisterRequest, why: str) -> None:
        message = (
            f"registration of node {request.node_id!r} (host {request.host}, pid {request.pid}) "
            f"refused: {why}"
        )
        log.warning("registration refused", node=request.node_id, why=why)
        self.timeline.emit(
            EventKind.REGISTRATION_REFUSED,
            message,
            node=request.node_id,
            host=request.host,
            pid=request.pid,
        )
        raise RegistrationRefused(message)

    async def join(self, request: JoinRequest, wait: float = 5.0) -> JoinReply:
        node = self._touch(request.node_id)
        if self.state.terminal or node.phase.gone:
            return JoinReply(state="exit", reason=self.reason or "the job is over")
        node.memory = list(request.memory)
        if request.last_step >= 0:
            node.step = max(node.step, request.last_step)
            for fault in self.faults:  # the survivors know best how far training got
                if fault.recovered_at is None:
                    fault.last_step = max(fault.last_step, request.last_step)
        if self.rounds.closed and request.node_id in self.rounds.world:
            return self._ready(request.node_id)
        if self.rounds.closed:
            node.phase = NodePhase.STANDBY
            await asyncio.sleep(min(wait, 1.0))
            return JoinReply(state="wait", reason="the running world is full; standing by")
        self.rounds.join(request.node_id, request.addr, request.port, time.time())
        node.phase = NodePhase.JOINED
        self._maybe_close()
        round_now, settled = self.rounds.round, self._round_settled
        try:
            await asyncio.wait_for(settled.wait(), timeout=wait)
        except asyncio.TimeoutError:
            return JoinReply(state="wait", reason=f"round {round_now} still forming")
        if self.state.terminal:
            return JoinReply(state="exit", reason=self.reason)
        if self.rounds.round == round_now and request.node_id in self.rounds.world:
            return self._ready(request.node_id)
        return JoinReply(state="wait", reason="standing by, or a newer round opened")

    def _ready(self, node_id: str) -> JoinReply:
        node = self.nodes[node_id]
        node.phase = NodePhase.RUNNING
        node.step = -1
        return JoinReply(
            state="ready",
            info=self.rounds.world[node_id],
            directives=RoundDirectives(
                restart_count=self.restarts, restore=self.restore, persist_step=self.persist_step
            ),
        )

    async def heartbeat(self, beat: Heartbeat, hold: float) -> Action:
        node = self._touch(beat.node_id)
        if beat.progress:
            node.step = max(p.step for p in beat.progress)
            self.diagnosis.progress(node, beat)
        if beat.first_step_time is not None and beat.round == self.rounds.round:
            self._first_step(node, beat)
        if not beat.wait:  # a progress update: the node's long poll collects actions
            return Action(kind="none", round=self.rounds.round)
        if node.action is None and not self.state.terminal:
            node.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(node.wake.wait(), timeout=hold)
        action, node.action = node.action, None
        if action is None and self.state.terminal:
            action = Action(kind="exit", reason=self.reason)
        return action or Action(kind="none", round=self.rounds.round)

    def workers_report(self, report: WorkersReport) -> None:
        node = self._touch(report.node_id)
        node.step = max(node.step, report.last_step)
        current = report.round == self.rounds.round and self.state is JobState.RUNNING
        if report.succeeded:
            if current:
                node.phase = NodePhase.SUCCEEDED
                if all(self.nodes[n].phase is NodePhase.SUCCEEDED for n in self.rounds.world):
                    last = max((n.step for n in self.nodes.values()), default=-1)
                    ok, why = self.checkpoints.end(last)
                    self._finish(JobState.SUCCEEDED if ok else JobState.FAILED, why)
            return
        if report.failure is None:
            raise BadReport("a report of failed workers must name the failure")
        # Peers of a failed worker fail too, often before its own report arrives: every
        # failure of a round goes into the timeline; the first one drives the restart.
        if not current:
            for failure in [report.failure, *report.also]:
                self._failure_event(node, report.round, failure, secondary=True)
            self.diagnosis.late_failures(node, report.round, [report.failure, *report.also])
            return
        failure, verdict = self.diagnosis.driver([report.failure, *report.also])
        node.phase = NodePhase.FAILED
        fault = Fault(
            kind="worker_failed",
            node=node.node_id,
            rank=failure.rank,
            detail=self._failure_event(node, report.round, failure, secondary=False),
            time=failure.time,
            action="restart workers in place",
            last_step=report.last_step,
        )
        for other in [report.failure, *report.also]:
            if other is not failure:
                self._failure_event(node, report.round, other, secondary=True)
        self.diagnosis.act(node, fault, verdict)

    def _failure_event(
        self, node: Node, round_: int, failure: WorkerFailure, *, secondary: bool
    ) -> str:
        detail = f"rank {failure.rank} (node {node.node_id}) {failure.description}"
        self.timeline.emit(
            EventKind.FAULT_DETECTED,
            f"{detail} (also in round {round_})" if secondary else detail,
            node=node.node_id,
            rank=failure.rank,
            fault="worker_failed",
            secondary=secondary,
            exitcode=failure.exitcode,
            signal=failure.signal,
            log_tail=failure.log_tail,
            round=round_,
            **self.diagnosis.event_fields(failure),
        )
        return detail

    def chaos(self, report: ChaosReport) -> None:
        self.timeline.emit(
            EventKind.FAULT_DETECTED,
            f"chaos: {report.rule.kind} on node {report.node_id}",
            node=report.node_id,
            fault="chaos",
            rule=report.rule.model_dump(mode="json"),
        )

    def hang(self, report: HangReport) -> None:
        self.diagnosis.hang(report)

    def unhealthy(self, report: HealthReport) -> None:
        self.diagnosis.unhealthy(report)

    def status(self) -> JobStatus:
        rank_of = {n: i.node_rank for n, i in self.rounds.world.items()}
        return JobStatus(
            job=self.spec.job,
            run_id=self.spec.run_id,
            state=self.state.value,
            round=self.rounds.round,
            restarts=self.restarts,
            max_restarts=self.spec.max_restarts,
            step=max((n.step for n in self.nodes.values() if n.node_id in rank_of), default=-1),
            nodes=[
                NodeStatus(
                    node_id=n.node_id,
                    host=n.host,
                    state=n.phase.value,
                    node_rank=rank_of.get(n.node_id),
                    step=n.step,
                )
                for n in self.nodes.values()
            ],
            reason=self.reason,
        )

    # -- policy ---------------------------------------------------------------------------

    def _touch(self, node_id: str) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyError(node_id)
        node.last_seen = time.monotonic()
        return node

    def _first_step(self, node: Node, beat: Heartbeat) -> None:
        info = self.rounds.world.get(node.node_id)
        if info is None or info.node_rank != 0 or beat.first_step_time is None:
            return
        if self.first_step_at is None:
            self.first_step_at = beat.first_step_time
        # The workers' own record of their first step: the board's current step may be
        # several steps on by the time the agent looked.
        first = min(
            (p.first_step if p.first_step >= 0 else p.step for p in beat.progress if p.step >= 0),
            default=None,
        )
        for fault in self.faults:
            if fault.restart_round == beat.round and fault.recovered_at is None:
                fault.recovered_at = beat.first_step_time
                fault.first_step_after = first
                self.timeline.emit(
                    EventKind.WORKERS_RESTARTED,
                    f"recovered from {fault.kind} in {fault.recovery_s:.2f}s",
                    node=fault.node,
                    recovery_s=fault.recovery_s,
                    steps_lost=fault.steps_lost,
                    round=beat.round,
                )

    def _restart(self, fault: Fault) -> None:
        self.faults.append(fault)
        if self.restarts >= self.spec.max_restarts:
            fault.action = "stop: restart budget spent"
            self._finish(
                JobState.FAILED,
                f"restart budget spent ({self.restarts} of {self.spec.max_restarts} restarts "
                f"used); last fault: {fault.detail}",
            )
            return
        self.restarts += 1
        round_now = self._open_round()
        fault.restart_round = round_now
        for node in self.nodes.values():
            if not node.phase.gone and node.phase is not NodePhase.LAUNCHED:
                node.send(Action(kind="restart", round=round_now, reason=fault.detail))
        self.timeline.emit(
            EventKind.WORKERS_RESTARTED,
            f"restart {self.restarts}/{self.spec.max_restarts}: {fault.action} "
            f"after {fault.detail}",
            round=round_now,
            restart=self.restarts,
        )

    def _node_lost(self, node: Node, why: str) -> None:
        fault = Fault(
            kind="node_lost",
            node=node.node_id,
            detail=f"node {node.node_id} ({node.host}) lost: {why}",
            time=time.time(),
            action="replace the node",
            last_step=node.step,
        )
        self.timeline.emit(
            EventKind.FAULT_DETECTED, fault.detail, node=node.node_id, fault="node_lost"
        )
        self._lose_node(node, fault, exclude_host=False)

    def _lose_node(
        self, node: Node, fault: Fault, *, exclude_host: bool, replace: bool = True
    ) -> None:
        """Take ``node`` out of the job and ask the scheduler for another (``exclude_host``:
        never on this host again; ``replace=False``: only release it); restart the world if it
        was in it."""
        if node.phase.gone:
            return
        in_world = node.node_id in self.rounds.world
        node.phase = NodePhase.LOST
        self.rounds.leave(node.node_id)
        node.send(Action(kind="exit", reason=fault.detail))
        if in_world and self.state is JobState.RUNNING:
            self._restart(fault)
        else:
            self.faults.append(fault)
        if self.state.terminal:
            return  # the job is over (this loss may have spent its budget): stop() frees all
        work = self._replace(node, exclude_host) if replace else self._release(node, fault)
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, node: Node, exclude_host: bool = False) -> None:
        try:
            handle = await self._call(
                self.scheduler.replace, node.node_id, exclude_host=exclude_host
            )
        except Exception as exc:
            if self.state.terminal:
                return  # the job ended meanwhile and interrupted the scheduler: no news
            log.warning("node replacement failed", node=node.node_id, error=str(exc))
            self.timeline.emit(
                EventKind.NODE_REPLACED,
                f"replacing {node.node_id} failed: {exc}",
                node=node.node_id,
                ok=False,
            )
            return
        if self.state.terminal:
            return
        self.nodes[handle.node_id] = Node(handle.node_id, handle.host)
        if exclude_host:
            self.timeline.emit(
                EventKind.NODE_EXCLUDED,
                f"host {node.host} excluded (node {node.node_id})",
                node=node.node_id,
                host=node.host,
            )
        self.timeline.emit(
            EventKind.NODE_REPLACED,
            f"node {node.node_id} replaced by {handle.node_id} on {handle.host}",
            node=node.node_id,
            replacement=handle.node_id,
        )

    def replacing(self) -> bool:
        """Whether a replacement asked of the scheduler has not come back yet."""
        return any(not task.done() for task in self._tasks)

    async def _release(self, node: Node, fault: Fault) -> None:
        """Stop ``node`` and ask for none in its place."""
        try:
            await self._call(self.scheduler.stop, [node.node_id])
        except Exception as exc:
            log.warning("stopping a node failed", node=node.node_id, error=str(exc))
        self.timeline.emit(
            EventKind.NODE_REPLACED,
            f"node {node.node_id} ({node.host}) stopped, not replaced: {fault.action}",
            node=node.node_id,
            ok=False,
        )

    def _preflight_done(self, *, faulty: int, stragglers: int, message: str) -> None:
        """The pre-flight check is over: open the first round, or, when it was all the job
        had to do (``planaria check --preflight``), finish with its verdict."""
        if self.state.terminal:
            return
        if self.settings.diagnosis.preflight.only:
            ok = faulty == 0 and stragglers == 0
            self._finish(JobState.SUCCEEDED if ok else JobState.FAILED, message)
            return
        self._open_round()

    def _open_round(self) -> int:
        self._round_settled.set()  # waiters of the old round re-join the new one
        self._round_settled = asyncio.Event()
        self.state = JobState.RENDEZVOUS
        return self.rounds.open(time.time())

    def _maybe_close(self) -> None:
        if self.state is not JobState.RENDEZVOUS or self.rounds.closed:
            return
        now = time.time()
        expected = {n.node_id for n in self.nodes.values() if not n.phase.gone}
        if self.rounds.ready(expected, now):
            world = self.rounds.close()
            self.state = JobState.RUNNING
            self._round_settled.set()
            ranks = {n: i.node_rank for n, i in world.items()}
            restore = self._decide_restore()
            self.timeline.emit(
                EventKind.RENDEZVOUS_COMPLETED,
                f"round {self.rounds.round}: {len(world)} node(s), "
                f"world size {next(iter(world.values())).world_size}; restore from {restore}",
                round=self.rounds.round,
                ranks=ranks,
                restore=self.restore,
                persist_step=self.persist_step,
            )
        elif now - self.rounds.opened_at > self.settings.join_timeout:
            self._finish(
                JobState.FAILED,
                f"rendezvous timed out: {self.rounds.joined} node(s) joined round "
                f"{self.rounds.round} within {self.settings.join_timeout:g}s, at least "
                f"{self.settings.min_nodes} needed",
            )

    def _decide_restore(self) -> str:
        """Memory when every rank of the new world holds a common step, else storage; with
        ``persist_on_fault``, a restart also persists that step if storage lacks it."""
        world = self.rounds.world
        step, why = agree(world, {n: self.nodes[n].memory for n in world}, self.spec.procs_per_node)
        self.restore = "storage" if step is None else f"memory:{step}"
        checkpoint = self.spec.checkpoint
        self.persist_step = None
        if (
            step is not None
            and checkpoint is not None
            and checkpoint.persist_on_fault
            and self.restarts > 0
            and step > self.checkpoints.committed_step
        ):
            self.persist_step = step
        where = "storage" if step is None else f"memory (step {step})"
        for fault in self.faults:
            if fault.restart_round == self.rounds.round:
                fault.restored_from = where
        log.info("restore decided", round=self.rounds.round, restore=self.restore, why=why)
        return f"{where}: {why}"

    def checkpoint_event(self, report: CheckpointEvent) -> None:
        node = self._touch(report.node_id)
        stop = self.checkpoints.event(node.node_id, report)
        if stop is not None:
            self._finish(JobState.FAILED, stop)

    def _maybe_grow(self) -> None:
        """Nodes standing by can enlarge a world below ``max``: re-form it with them (a
        membership change, as torchrun does; not a fault, so not charged to the budget)."""
        if self.state is not JobState.RUNNING:
            return
        standby = [n for n in self.nodes.values() if n.phase is NodePhase.STANDBY]
        size = len(self.rounds.world)
        grown = min(size + len(standby), self.settings.max_nodes)
        grown = grown // self.settings.node_unit * self.settings.node_unit
        if not standby or grown <= size:
            return
        members = set(self.rounds.world)
        round_now = self._open_round()
        for node_id in members:
            self.nodes[node_id].send(Action(kind="restart", round=round_now, reason="scale up"))
        self.timeline.emit(
            EventKind.WORKERS_RESTARTED,
            f"scale up: {len(standby)} node(s) standing by join; round {round_now}",
            round=round_now,
            standby=[n.node_id for n in standby],
        )

    def _finish(self, state: JobState, reason: str) -> None:
        if self.state.terminal:
            return
        self.state = state
        self.reason = reason
        self.finished_at = time.time()
        self.scheduler.interrupt()  # a launch in flight (on the scheduler's thread) stops
        self._round_settled.set()
        for node in self.nodes.values():
            node.send(Action(kind="exit", reason=reason))
        kind = EventKind.JOB_FINISHED if state is JobState.SUCCEEDED else EventKind.JOB_STOPPED
        self.timeline.emit(kind, reason, state=state.value)

    def fail(self, reason: str) -> None:
        self._finish(JobState.FAILED, reason)

    # -- main loop ------------------------------------------------------------------------

    async def run(self, launch: LaunchSpec) -> Summary:
        """Launch the nodes (``launch`` is what each runs: the agent) and see the job through."""
        await self.launch(launch)
        exit_deadline: float | None = None
        ticked = time.monotonic()
        while True:
            await asyncio.sleep(TICK)
            now = time.time()
            for event in await self._call(self.scheduler.poll, 0.0):
                self._on_node_event(event)
            seen, ticked = ticked, time.monotonic()
            self._renew_after_stall(ticked - seen)
            if not self.state.terminal:
                for node in list(self.nodes.values()):
                    # A node still pending is the scheduler's business; the rendezvous
                    # timeout covers one that never comes.
                    late = ticked - node.last_seen > self.spec.heartbeat_timeout
                    late = late and not self.preflight.busy(node.node_id)
                    if late and node.phase is not NodePhase.LAUNCHED and not node.phase.gone:
                        self._node_lost(node, f"no heartbeat for {self.spec.heartbeat_timeout:g}s")
                if self.state is JobState.PREFLIGHT:
                    self.preflight.tick(now)
                self._maybe_close()
                self._maybe_grow()
                continue
            if exit_deadline is None:
                exit_deadline = now + self.spec.stop_grace + self.spec.heartbeat_interval + 2.0
            settled = all(
                n.phase.gone or n.phase is NodePhase.LAUNCHED for n in self.nodes.values()
            )
            if settled or now > exit_deadline:
                break
        # Replacements asked before the end come back first: nothing of the job's may write to
        # its timeline once this returns (the caller closes it).
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._call(self.scheduler.stop, None)
        self._executor.shutdown(wait=True)
        return self.summary()

    def stall_threshold(self) -> float:
        """A gap between two ticks beyond which the master counts itself as having stalled."""
        return max(0.5, min(self.spec.heartbeat_interval, self.spec.heartbeat_timeout / 4))

    def _renew_after_stall(self, gap: float) -> None:
        """After the master itself stalled (stopped, swapped out, starved of CPU), the silence
        it saw is its own: heartbeats queued on its sockets have not been read yet. Like a
        lease holder after a pause, it does not count its blind time against any node: every
        heartbeat window is moved on by the stall (a node that was heard just before a long
        stall gets a fresh window). Silence outside stalls still adds up, so a master that
        keeps stalling still finds a node that went quiet, only later."""
        if gap <= self.stall_threshold():
            return
        now = time.monotonic()
        for node in self.nodes.values():
            node.last_seen = min(now, node.last_seen + gap)
        log.warning("master stalled; heartbeat windows renewed", seconds=round(gap, 3))
        if gap > self.spec.heartbeat_interval * 2:
            self.timeline.emit(
                EventKind.MASTER_STALLED,
                f"the master stalled for {gap:.1f}s; every node's heartbeat window renewed",
                seconds=round(gap, 3),
            )

    def summary(self) -> Summary:
        end = self.finished_at or time.time()
        startup = None if self.first_step_at is None else self.first_step_at - self.started
        downtime = sum(f.recovery_s or 0.0 for f in self.faults)
        steps = max((n.step for n in self.nodes.values()), default=-1) + 1
        return Summary(
            state=self.state.value,
            reason=self.reason,
            steps=steps,
            wall_s=end - self.started,
            startup_s=startup,
            downtime_s=downtime,
            restarts=self.restarts,
            faults=list(self.faults),
            checkpoints=self.checkpoints.committed,
            last_checkpoint=(
                self.checkpoints.committed_step if self.checkpoints.committed_step >= 0 else None
            ),
            unpersisted=self.checkpoints.unpersisted(steps - 1),
            skipped_checkpoints=[f"step {s}: {why}" for s, why in self.checkpoints.skipped.items()],
            started_from_scratch=self.checkpoints.scratch,
            persister_restarts=self.checkpoints.persister_restarts,
            stragglers=list(self.diagnosis.stragglers),
            preflight=self.preflight.report if self.settings.diagnosis.preflight.enabled else None,
        )


def _ignore(event: JobEvent) -> None:
    pass
