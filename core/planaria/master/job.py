"""The master: one job's state, the API's handlers and the job's rounds.

All state lives on one asyncio loop, so handlers and ticks never race. The parts around it:
its nodes, their heartbeats and every scheduler call are :class:`~planaria.master.fleet.Fleet`'s;
what a fault calls for is :func:`planaria.master.policy.decide`'s to say and
:class:`~planaria.master.recovery.Recovery`'s to do; diagnosis and the pre-flight check find
faults and see the job only through :class:`~planaria.master.control.JobControl`, which this
class is; :func:`planaria.master.runner.supervise` drives it in time.

Why one module: the handlers and the rounds change one state machine (the job's state and its
rounds), and each handler is a few lines on it that read best beside the others; what stands
alone (the nodes, the policy, recovery, diagnosis, the journal's group commit, restore) is in
a module of its own already.
"""

from __future__ import annotations

import asyncio
import functools
import random
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from planaria import events
from planaria.errors import SchedulerError
from planaria.events import JobEvent, Payload, StopCause
from planaria.log import get_logger
from planaria.master import restore
from planaria.master.advertise import url_host
from planaria.master.checkpoints import Fence, JobCheckpoints
from planaria.master.commit import GroupCommit
from planaria.master.diagnosis import Diagnosis
from planaria.master.fleet import Fleet
from planaria.master.journal import NAME as JOURNAL_FILE
from planaria.master.journal import Journal, JournalError, Journalled, damaged, mark_ended
from planaria.master.policy import Decision, FaultType, Source
from planaria.master.preflight import Preflight
from planaria.master.recovery import Recovery
from planaria.master.rounds import Rounds
from planaria.master.state import (
    BadReport,
    ChannelStats,
    Deferred,
    FencedRequest,
    JobSettings,
    JobState,
    Node,
    NodePhase,
    NotAttached,
    RegistrationRefused,
    UnknownNode,
    Wake,
)
from planaria.master.store import StoreHost
from planaria.master.summary import FailedRank, Fault, Summary
from planaria.master.timeline import Timeline, last_steps, last_tokens
from planaria.master.tokens import TokenCount
from planaria.protocol import (
    SPREAD_NODES,
    Action,
    ActionRequest,
    CheckpointEvent,
    Heartbeat,
    HeartbeatReply,
    JobSpec,
    JobStatus,
    JoinReply,
    JoinRequest,
    RankProgress,
    ReattachReply,
    ReattachRequest,
    RegisterRequest,
    RendezvousInfo,
    ReplicaEndpoint,
    ReplicaFetch,
    ReplicaHolding,
    RoundDirectives,
    WorkersOutput,
    WorkersReport,
)
from planaria.scheduler.api import (
    AdmitsNodes,
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    Scheduler,
)

log = get_logger("master")

PROGRESS_EVERY = 5.0
"""Seconds between two ``progress`` events of a node (plus one at each round's first step and
one at the node's end): enough to plot a job's course, for one comparison a heartbeat."""
PROGRESS_NODES = 64
"""Beyond this many nodes the interval grows with their number: the whole job writes at most
about ``PROGRESS_NODES / PROGRESS_EVERY`` of them a second; and a node's first of a round comes
at a random time within the interval, not at its first step (10,000 nodes starting a round would
write 10,000 at once)."""


_LAST_REPLY: list[HeartbeatReply] = []
"""The heartbeat reply made last (one slot)."""


def beat_reply(action: Action) -> HeartbeatReply:
    """The reply that carries ``action``: the one made last when it carried the same action
    (models are frozen: every heartbeat of a round shares its "nothing due", every node of a
    restart its restart)."""
    if _LAST_REPLY and _LAST_REPLY[0].action is action:
        return _LAST_REPLY[0]
    reply = HeartbeatReply(action=action)
    _LAST_REPLY[:] = [reply]
    return reply


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
        self.rounds = Rounds(
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            node_unit=settings.node_unit,
            join_grace=settings.join_grace,
            procs_per_node=self.spec.procs_per_node,
            placement=settings.placement,
        )
        self.timeline = Timeline(run_dir / "events.jsonl", self.spec.job, observer or _ignore)
        self.on_output: Callable[[WorkersOutput], None] = lambda report: None
        """Where the workers' lines go (``planaria run`` prints them)."""
        self.fleet = Fleet(
            scheduler, self.timeline, self.spec.heartbeat_interval, self.spec.heartbeat_timeout
        )
        self.started = time.time()
        self.first_step_at: float | None = None
        self.first_step = 0
        """The number of the first step the job's workers reported: steps are counted from
        it, so a script that numbers them from 1 (or from a step restored from an earlier
        run) does not get one more than it did."""
        self.last_step = -1
        """The highest step anything told of: heartbeats, joins, the workers' reports and
        checkpoint events (a step checkpointed is a step done, even when the heartbeat that
        would have said so never came, as when the job is stopped). Unlike a node's step it
        never goes back: a new round starts the nodes' steps afresh. Steps done count to it."""
        self._idle = Action(kind="none", round=-1)
        """What :meth:`_no_action` answers in the current round."""
        self.finished_at: float | None = None
        self.loss: tuple[int, int, float] | None = None
        """Rank 0's last training loss: (its round, its step, the loss); None until a worker
        reported one (``planaria.monitor.step(n, loss=...)``)."""
        self.tokens = TokenCount()
        """The job's tokens, as rank 0's heartbeats brought them
        (``planaria.monitor.step(n, tokens=...)``)."""
        self._round_settled = Wake()
        """Set when the forming round closes, is superseded or the job ends."""
        self._next_round = Wake()
        """Set when a round opens or the job ends: the joins of nodes standing by wait on it."""
        self._standing: set[str] = set()
        """The nodes that stood by when the forming round opened."""
        self.restore = "storage"
        """Where this round's workers restore from: ``memory:<step>`` or ``storage``."""
        self.persist_step: int | None = None
        self._replica_plan: dict[str, tuple[ReplicaEndpoint | None, list[ReplicaFetch]]] = {}
        """Each node's buddy and the replicas it fetches, this round (``checkpoint.replica``)."""
        self._refused_replicas: set[tuple[str, int, int]] = set()
        """(holder, rank, step) of replicas a fetch failed on: not planned from again."""
        self.checkpoints = JobCheckpoints(self.spec.checkpoint, self.timeline)
        self.recovery = Recovery(self, settings.rules, self.fleet, self.rounds, self.timeline)
        self.diagnosis = Diagnosis(self, settings.diagnosis)
        self.preflight = Preflight(self, settings.diagnosis.preflight)
        self.fleet.grace = self.spec.master_grace
        self.journal: Journal | None = None
        self._group_commit = GroupCommit(self.journal_now)
        self._told_fenced: set[str] = set()
        self.fence = Fence(self.spec.checkpoint)
        self._down: float | None = None
        """A resumed master's: how long the job went without one."""
        self._reattached: set[str] = set()
        """Nodes that re-attached to this master: a retried re-attach changes nothing."""
        self.not_written: dict[str, str] = {}
        """Files of the run's record that could not be written, and why (a full disk)."""
        self.channel = ChannelStats()
        """Kept up by the agents' channels, for the metrics."""
        self.store: StoreHost | None = None
        """The workers' store on the master's host (``rendezvous.store: master``), once the
        runner started it; None: the worker of rank 0 hosts each round's."""

    # -- the journal ------------------------------------------------------------------------

    def keep_journal(self, journal: Journal) -> None:
        """Journal the job's state from now on (:mod:`planaria.master.journal`)."""
        self.journal = journal
        self.fleet.journal = journal
        for node in self.nodes.values():
            node.on_change = journal.node_changed
            journal.node_changed(node.node_id)
        self.journal_now()

    def snapshot(self) -> dict[str, Any]:
        return {
            "job": {
                "state": self.state.value,
                "reason": self.reason,
                "started": self.started,
                "first_step_at": self.first_step_at,
                "first_step": self.first_step,
                "finished_at": self.finished_at,
                "restore": self.restore,
                "persist_step": self.persist_step,
            },
            "rounds": self.rounds.snapshot(),
            "recovery": self.recovery.snapshot(),
            "checkpoints": self.checkpoints.snapshot(),
            "fence": self.fence.generation,
        }

    def journal_now(self) -> None:
        """Write what changed since the last write, now (after each tick; a request's changes
        go in the next group commit, :meth:`journal_commit`). Once the
        job has ended a failed write is no error: the end mark holds the end (see
        :mod:`planaria.master.journal`), and the summary names what was not written."""
        if self.journal is None:
            return
        ended = self.state.terminal
        try:
            self.journal.write(self.snapshot(), self.nodes, last=ended)
        except (sqlite3.Error, OSError) as exc:
            if not ended:
                raise
            self.could_not_write(JOURNAL_FILE, exc)
        else:
            self.not_written.pop(JOURNAL_FILE, None)

    def could_not_write(self, name: str, exc: BaseException) -> None:
        """Keep (and log, once) that file ``name`` of the run's record could not be written."""
        why = getattr(exc, "strerror", None) or str(exc)
        if name not in self.not_written:
            log.error("cannot write the run's record", file=name, error=why)
        self.not_written[name] = why

    async def journal_committed(self) -> None:
        """Return once what changed so far is in the journal: the requests answered in one
        turn of the loop share one write (:mod:`planaria.master.commit`)."""
        written = self.journal_commit()
        if written is not None:
            # Shielded: a request given up (its client gone) must not cancel the others' write.
            await asyncio.shield(written)

    def journal_commit(self) -> asyncio.Future[None] | None:
        """The journal's next group commit (:mod:`planaria.master.commit`), done once what
        changed so far is in the journal (see :meth:`journal_committed`); None without a
        journal. Not to be cancelled: it is shared."""
        if self.journal is None:
            return None
        return self._group_commit.next()

    def resume(self, journalled: Journalled) -> None:
        """Take the job over where the master before this one left it. The nodes it had
        are expected back: every one is asked to re-attach first (agents keep their workers
        training meanwhile), and each gets a fresh heartbeat window. Writes nothing (see
        :meth:`announce_resume`); raises :class:`JournalError` naming what is damaged."""
        path = self.run_dir / JOURNAL_FILE
        parts = journalled.parts
        for name in ("job", "rounds", "recovery", "checkpoints", "fence"):
            if name not in parts:
                raise JournalError(
                    f"the master journal {path} is damaged: it has no {name!r} part (table parts)"
                )
        with damaged(path, "part 'job'"):
            job = parts["job"]
            self.state = JobState(job["state"])
            self.reason = str(job["reason"])
            self.started = float(job["started"])
            self.first_step_at = job["first_step_at"]
            self.first_step = int(job.get("first_step", 0))
            self.finished_at = job["finished_at"]
            self.restore = str(job["restore"])
            self.persist_step = job["persist_step"]
        with damaged(path, "part 'rounds'"):
            self.rounds.restore(parts["rounds"], time.time())
        with damaged(path, "part 'recovery'"):
            self.recovery.restore(parts["recovery"])
        with damaged(path, "part 'checkpoints'"):
            self.checkpoints.restore(parts["checkpoints"])
        self.saw_step(self.checkpoints.committed_step)
        with damaged(path, "part 'fence'"):
            self.fence.generation = int(parts["fence"])
        topology: dict[str, dict[str, str]] = {}
        for node_id, raw in journalled.handles.items():
            with damaged(path, f"the handle of node {node_id!r}"):
                topology[node_id] = NodeHandle.model_validate(raw).topology
        self.preflight.finished = True
        now = time.monotonic()
        # What training had reached when the master before this one last heard: a fault of
        # a node that never comes back counts the steps redone from there.
        steps = last_steps(self.timeline.path, self.rounds.round)
        self.tokens = last_tokens(self.timeline.path)
        for node_id, record in journalled.nodes.items():
            with damaged(path, f"node {node_id!r}"):
                node = Node.from_record(record)
            node.topology = dict(topology.get(node.node_id, {}))
            node.attached = node.phase in (NodePhase.LAUNCHED,) or node.phase.gone
            node.last_seen = now
            node.step = steps.get(node.node_id, -1)
            self.saw_step(node.step)
            self.fleet.add(node)
        if self.state is JobState.RENDEZVOUS:  # re-formed from the joins that come now
            self._round_settled = Wake()
        clock = parts.get("clock")
        self._down = None if not isinstance(clock, float) else max(0.0, time.time() - clock)

    def announce_resume(self) -> None:
        """Put the resume in the timeline, once the resumed master serves its API."""
        expected = [n.node_id for n in self.nodes.values() if not n.attached]
        self.timeline.emit(
            events.MasterResumed(round=self.rounds.round, nodes=expected, down_s=self._down),
            f"master resumed the job at round {self.rounds.round} ({self.state.value}); "
            f"{len(expected)} node(s) to re-attach",
        )

    def reattach(self, request: ReattachRequest) -> ReattachReply:
        """An agent re-attaches to this restarted master: if its workers run the current
        round with the rank the journal gives it, they go on untouched."""
        node = self.nodes.get(request.node_id)
        if node is None:
            raise UnknownNode(request.node_id)
        if node.phase is NodePhase.LOST:
            self._fenced(node, "reattach")
        if (node.pid, node.host) != (request.pid, request.host):
            raise RegistrationRefused(
                f"node {request.node_id} is agent pid {node.pid} on {node.host}, not pid "
                f"{request.pid} on {request.host}"
            )
        node.attached = True
        node.last_seen = time.monotonic()
        node.memory = list(request.memory)
        node.step = max(node.step, request.last_step)
        self.saw_step(request.last_step)
        if node.node_id in self._reattached:  # a retry (its answer was lost): told already
            return ReattachReply(state="continue")
        self._reattached.add(node.node_id)
        info = self.rounds.world.get(node.node_id)
        current = (
            self.rounds.closed
            and info is not None
            and request.round == self.rounds.round
            and request.node_rank == info.node_rank
        )
        restart = request.round is not None and not current and not self.state.terminal
        if restart:  # the job went on without this node's round: its workers start again
            node.send(Action(kind="restart", round=self.rounds.round, reason="master resumed"))
        elif self.state.terminal:
            node.send(Action(kind="exit", reason=self.reason))
        self.timeline.emit(
            events.NodeReattached(round=request.round, restarted=restart),
            f"node {node.node_id} re-attached"
            + (f" (round {request.round})" if request.round is not None else "")
            + ("; its workers restart into the current round" if restart else ""),
            node=node.node_id,
        )
        return ReattachReply(state="continue")

    # -- what observers see (JobControl) ---------------------------------------------------

    @property
    def nodes(self) -> dict[str, Node]:
        return self.fleet.nodes

    @property
    def restarts(self) -> int:
        return self.recovery.restarts

    @property
    def faults(self) -> list[Fault]:
        return self.recovery.faults

    @property
    def round(self) -> int:
        return self.rounds.round

    @property
    def world(self) -> Mapping[str, RendezvousInfo]:
        return self.rounds.world

    @property
    def training(self) -> bool:
        return self.state is JobState.RUNNING

    @property
    def stopping(self) -> bool:
        return self.state.terminal

    @property
    def steps_known(self) -> bool:
        return self.first_step_at is not None

    @property
    def stop_reason(self) -> str:
        return self.reason

    def heard_from(self, node_id: str, *, fence: bool = True) -> Node:
        """The node a request comes from. One the master declared lost is fenced (``fence``:
        told to stop; its reports of what happened are still taken); one that has not
        re-attached to a restarted master is asked to first."""
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNode(node_id)
        if node.phase is NodePhase.LOST and fence:
            self._fenced(node)
        if not node.attached:
            raise NotAttached(node_id)
        node.last_seen = time.monotonic()
        return node

    def _fenced(self, node: Node, request: str = "") -> None:
        if node.node_id not in self._told_fenced:
            self._told_fenced.add(node.node_id)
            self.timeline.emit(
                events.NodeFenced(request=request),
                f"node {node.node_id} ({node.host}), declared lost, reached the master again: "
                "told to stop its workers",
                node=node.node_id,
            )
        raise FencedRequest(
            f"node {node.node_id} was declared lost and is fenced out of the job: stop its "
            "workers (another node may be training in its place)"
        )

    def replacing(self) -> bool:
        return self.fleet.replacing() > 0

    def emit(
        self,
        payload: Payload,
        message: str,
        *,
        node: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> JobEvent:
        return self.timeline.emit(payload, message, node=node, rank=rank, step=step)

    def fence_out(self, node: Node) -> None:
        """``node`` is declared lost: no round it ran in may commit a checkpoint any more.
        The round that goes on without it is the one forming, or the next one; a node lost
        while standing by, out of the running world, ran in none of the running round's:
        that round may go on committing."""
        running_in = self.rounds.closed and node.node_id in self.rounds.world
        generation = self.rounds.round + 1 if running_in else self.rounds.round
        self.fence.raise_to(generation, node.node_id)

    def stop(self, reason: str, cause: StopCause = StopCause.INTERRUPTED) -> None:
        self._finish(JobState.FAILED, reason, cause)

    def report_fault(
        self,
        fault: Fault,
        type_: FaultType,
        source: Source,
        *,
        before: Callable[[Decision], None] | None = None,
    ) -> Decision:
        return self.recovery.report(fault, type_, source, before)

    def preflight_finished(self, *, passed: bool, message: str) -> None:
        if self.state.terminal:
            return
        if self.settings.diagnosis.preflight.only:
            state = JobState.SUCCEEDED if passed else JobState.FAILED
            self._finish(state, message, StopCause.PREFLIGHT)
            return
        self.open_round()

    # -- handlers (called by the HTTP server) ----------------------------------------------

    def register(self, request: RegisterRequest) -> JobSpec:
        self.fleet.register(request)
        return self.spec

    def join(self, request: JoinRequest, wait: float = 5.0) -> JoinReply | Deferred[JoinReply]:
        """A node joins the forming round: ``ready`` with its rank once the round closes,
        held at most ``wait`` seconds (then ``wait``: ask again)."""
        node = self.heard_from(request.node_id)
        if self.state.terminal or node.phase.gone:
            return JoinReply(state="exit", reason=self.reason or "the job is over")
        node.memory = list(request.memory)
        node.replicas = list(request.replicas)
        node.replica_port = request.replica_port
        if request.addr:
            node.addr = request.addr
        if request.last_step >= 0:
            node.step = max(node.step, request.last_step)
            self.saw_step(request.last_step)
            self.recovery.progressed(request.last_step)
        if self.rounds.closed and request.node_id in self.rounds.world:
            return self._ready(request.node_id)
        if self.rounds.closed:
            node.phase = NodePhase.STANDBY
            standing = JoinReply(state="wait", reason="the running world is full; standing by")
            # Held until the next round opens (a lost node's place to take) or ``wait``.
            waiting = self._next_round.waiter(wait)
            return standing if waiting is None else Deferred(waiting, lambda: standing)
        self.rounds.join(request.node_id, request.addr, request.port, time.time(), node.topology)
        node.phase = NodePhase.JOINED
        self._maybe_close()
        round_now, settled = self.rounds.round, self._round_settled
        waiting = settled.waiter(wait)
        if waiting is None:
            return self._joined(node, round_now, settled)
        return Deferred(waiting, lambda: self._joined(node, round_now, settled))

    def _joined(self, node: Node, round_now: int, settled: Wake) -> JoinReply:
        node.last_seen = time.monotonic()  # its agent held the request open all along
        if not settled.is_set():
            return JoinReply(state="wait", reason=f"round {round_now} still forming")
        if self.state.terminal:
            return JoinReply(state="exit", reason=self.reason)
        if self.rounds.round == round_now and node.node_id in self.rounds.world:
            return self._ready(node.node_id)
        return JoinReply(state="wait", reason="standing by, or a newer round opened")

    def _ready(self, node_id: str) -> JoinReply:
        node = self.nodes[node_id]
        node.phase = NodePhase.RUNNING
        node.step = -1
        if len(self.nodes) <= PROGRESS_NODES:
            node.sampled = float("-inf")  # its first step in the round is worth a sample
        else:  # its first sample at a random time within the interval, not all at once
            node.sampled = time.monotonic() - random.random() * self._progress_every()
        return JoinReply(
            state="ready",
            info=self.rounds.world[node_id],
            directives=RoundDirectives(
                restart_count=self.restarts,
                restore=self.restore,
                persist_step=self.persist_step,
                replica_to=self._replica_plan.get(node_id, (None, []))[0],
                fetch=self._replica_plan.get(node_id, (None, []))[1],
            ),
        )

    def heartbeat(self, beat: Heartbeat, hold: float) -> Action | Deferred[Action]:
        """Take a node's heartbeat: its answer, or (a long poll) the answer held until an
        action is due to the node, at most ``hold`` seconds."""
        node = self.heard_from(beat.node_id)
        if beat.progress:
            node.step = max(p.step for p in beat.progress)
            self.saw_step(node.step)
            self.diagnosis.progress(node, beat)
            loss = self._new_loss(beat.node_id, beat.round, beat.progress)
            self._count_tokens(beat.node_id, beat.round, beat.progress)
            self._sample(node, beat.round, loss=loss)
        if beat.first_step_time is not None and beat.round == self.rounds.round:
            self._first_step(node, beat)
        if not beat.wait:  # a progress update: the node's long poll collects actions
            return self._no_action()
        if node.polled_round != beat.round:
            node.polled_round = beat.round
            if len(self.rounds.world) >= SPREAD_NODES:
                hold *= random.random()
        waiting = self.fleet.wait_for_action(node, hold, stopping=self.state.terminal)
        if waiting is None:
            return self._next_action(node)
        return Deferred(waiting, lambda: self._next_action(node))

    def next_action_for(self, request: ActionRequest) -> HeartbeatReply | Deferred[HeartbeatReply]:
        """A node's next action, answered the moment one is due (the channel's ``/actions``):
        no time limit, as the channel is watched by its own pings."""
        node = self.heard_from(request.node_id)
        waiting = self.fleet.wait_for_action(node, None, stopping=self.state.terminal)
        if waiting is None:
            return self._action_reply(node)
        # A partial, not a closure: one of these stands for every node (memory at 10,000).
        return Deferred(waiting, functools.partial(self._action_reply, node))

    def _action_reply(self, node: Node) -> HeartbeatReply:
        return beat_reply(self._next_action(node))

    def _next_action(self, node: Node) -> Action:
        action = self.fleet.next_action(node)
        node.last_seen = time.monotonic()  # the agent held the long poll open until now
        if action is None and self.state.terminal:
            action = Action(kind="exit", reason=self.reason)
        return action or self._no_action()

    def _no_action(self) -> Action:
        """Nothing due: one (frozen) action per round, shared by every reply that says so,
        rather than a model made per heartbeat."""
        if self._idle.round != self.rounds.round:
            self._idle = Action(kind="none", round=self.rounds.round)
        return self._idle

    def saw_step(self, step: int) -> None:
        """Some report told of ``step``: training got at least that far."""
        if step > self.last_step:
            self.last_step = step

    @property
    def newest_step(self) -> int:
        """The highest step heard of, from any node, lost ones included (-1: none)."""
        return max([self.last_step, *(n.step for n in self.nodes.values())])

    @property
    def steps_done(self) -> int:
        """Steps done in this run: from the first step reported to the newest, both counted
        (what the summary and ``planaria status`` say)."""
        last = self.newest_step
        return max(0, last - self.first_step + 1) if last >= 0 else 0

    def sample_last(self, node: Node) -> None:
        """A last ``progress`` event of a node leaving the running world (lost, taken out):
        the timeline, and ``planaria status`` once the job is over, show its last step, not
        the sample before it."""
        self._sample(node, self.rounds.round, last=True)

    def _new_loss(
        self, node_id: str, round_: int, progress: list[RankProgress]
    ) -> tuple[int, int, float] | None:
        """Rank 0's loss in a node's ``progress`` (a heartbeat's, or its workers' last), when
        it is news: the job's loss series is rank 0's (the one a training script prints), one
        point a report at most."""
        info = self.rounds.world.get(node_id)
        if info is None or info.rank_offset != 0 or round_ != self.rounds.round:
            return None
        for p in progress:
            if p.local_rank == 0 and p.loss is not None and p.loss_step >= 0:
                loss = (round_, p.loss_step, p.loss)
                if loss == self.loss:
                    return None
                self.loss = loss
                return loss
        return None

    def _count_tokens(self, node_id: str, round_: int, progress: list[RankProgress]) -> None:
        """Count rank 0's tokens in a node's ``progress`` into the job's
        (:mod:`planaria.master.tokens`)."""
        info = self.rounds.world.get(node_id)
        if info is None or info.rank_offset != 0 or round_ != self.rounds.round:
            return
        for p in progress:
            if p.local_rank == 0 and p.tokens is not None and p.tokens_step >= 0:
                self.tokens.heard(round_, p.tokens)
                return

    def _sample(
        self,
        node: Node,
        round_: int,
        *,
        last: bool = False,
        loss: tuple[int, int, float] | None = None,
    ) -> None:
        """A ``progress`` event of ``node``'s step, if its last is old enough (or ``last``, or
        it brings rank 0's new ``loss``)."""
        now = time.monotonic()
        due = now - node.sampled >= self._progress_every() or last or loss is not None
        if not due or self.state.terminal or node.step < 0:
            return
        node.sampled = now
        message = f"{node.node_id} at step {node.step}"
        fields: dict[str, Any] = {}
        if loss is not None:
            _, loss_step, value = loss
            message += f", loss {value:.6g} at step {loss_step}"
            fields.update(loss=value, loss_step=loss_step)
        info = self.rounds.world.get(node.node_id)
        tokens = self.tokens.sample(round_)
        if tokens is not None and info is not None and info.rank_offset == 0:
            fields.update(tokens=tokens[0], round_tokens=tokens[1])
            message += f", {tokens[0]:.0f} tokens"
        payload = events.Progress(round=round_, **fields)
        self.timeline.emit(payload, message, node=node.node_id, step=node.step)

    def _progress_every(self) -> float:
        return PROGRESS_EVERY * max(1.0, len(self.nodes) / PROGRESS_NODES)

    def _first_step(self, node: Node, beat: Heartbeat) -> None:
        info = self.rounds.world.get(node.node_id)
        if info is None or info.node_rank != 0 or beat.first_step_time is None:
            return
        # The workers' own record of their first step: the board's current step may be
        # several steps on by the time the agent looked.
        first = min(
            (p.first_step if p.first_step >= 0 else p.step for p in beat.progress if p.step >= 0),
            default=None,
        )
        if self.first_step_at is None:
            self.first_step_at = beat.first_step_time
            self.first_step = max(0, first) if first is not None else 0
        self.recovery.first_step(beat.round, beat.first_step_time, first)

    def workers_report(self, report: WorkersReport) -> None:
        node = self.heard_from(report.node_id, fence=False)  # a late report still tells
        node.step = max(node.step, report.last_step)
        self.saw_step(report.last_step)
        current = report.round == self.rounds.round and self.state is JobState.RUNNING
        loss = None
        if current:  # what the workers reported since the node's last heartbeat
            loss = self._new_loss(report.node_id, report.round, report.progress)
            self._count_tokens(report.node_id, report.round, report.progress)
        if report.succeeded:
            if current:
                self._sample(node, report.round, last=True, loss=loss)
                node.phase = NodePhase.SUCCEEDED
                if all(self.nodes[n].phase is NodePhase.SUCCEEDED for n in self.rounds.world):
                    ok, why = self.checkpoints.end(self.last_step)
                    state = JobState.SUCCEEDED if ok else JobState.FAILED
                    self._finish(state, why, StopCause.CHECKPOINT)
            return
        if report.failure is None:
            raise BadReport("a report of failed workers must name the failure")
        refused = report.failure.replica_error
        if refused is not None:  # the next round plans without that replica
            self._refused_replicas.add((refused.holder.node_id, refused.rank, refused.step))
        if current:
            self._sample(node, report.round, last=True, loss=loss)  # where its workers got to
            node.phase = NodePhase.FAILED
        self.diagnosis.workers_failed(node, report, current=current)

    def worker_output(self, report: WorkersOutput) -> None:
        """Lines a node's workers wrote: to the console (:mod:`planaria.agent.console`)."""
        self.heard_from(report.node_id, fence=False)
        self.on_output(report)

    def checkpoint_event(self, report: CheckpointEvent) -> None:
        node = self.heard_from(report.node_id, fence=False)
        if report.event in ("checkpoint_committed", "persist_failed"):
            # The step's state was saved: the step was done, heartbeat or not.
            node.step = max(node.step, report.step)
            self.saw_step(report.step)
        stop = self.checkpoints.event(node.node_id, report)
        if stop is not None:
            self._finish(JobState.FAILED, stop, StopCause.CHECKPOINT)

    def status(self) -> JobStatus:
        rank_of = {n: i.node_rank for n, i in self.rounds.world.items()}
        return JobStatus(
            job=self.spec.job,
            run_id=self.spec.run_id,
            state=self.state.value,
            round=self.rounds.round,
            restarts=self.restarts,
            max_restarts=self.spec.max_restarts,
            step=self.newest_step,
            steps_done=self.steps_done,
            nodes=self.fleet.statuses(rank_of),
            reason=self.reason,
        )

    # -- rounds -----------------------------------------------------------------------------

    def open_round(self) -> int:
        self._round_settled.set()  # waiters of the old round re-join the new one
        self._round_settled = Wake()
        self._next_round.set()  # and so do the nodes standing by
        self._next_round = Wake()
        self._standing = {n.node_id for n in self.nodes.values() if n.phase is NodePhase.STANDBY}
        self.state = JobState.RENDEZVOUS
        return self.rounds.open(time.time())

    def _maybe_close(self) -> None:
        if self.state is not JobState.RENDEZVOUS or self.rounds.closed:
            return
        now = time.time()
        ready = self.rounds.ready(self.fleet.alive(), now)  # every joiner is alive (leave())
        store = None
        if ready and self.store is not None:  # the round waits for its store (a starting host)
            store = self.store.take(self.rounds.round)
        if ready and (self.store is None or store is not None):
            world = self.rounds.close(store)
            self.state = JobState.RUNNING
            self._round_settled.set()
            plan = restore.plan(
                world,
                {n: self.nodes[n].memory for n in world},
                self.spec.procs_per_node,
                persist_on_fault=bool(
                    self.spec.checkpoint and self.spec.checkpoint.persist_on_fault
                ),
                restarted=self.restarts > 0,
                committed_step=self.checkpoints.committed_step,
                replicas={n: self._usable_replicas(n) for n in world},
            )
            self.restore, self.persist_step = plan.restore, plan.persist_step
            self._replica_plan = self._replicas_for(world, plan)
            self.recovery.restored(self.rounds.round, plan.where)
            log.info("restore decided", round=self.rounds.round, restore=plan.restore, why=plan.why)
            size = next(iter(world.values())).world_size
            promoted = sorted(n for n in world if n in self._standing)
            taken = f" ({', '.join(promoted)} from standby)" if promoted else ""
            self.timeline.emit(
                events.RendezvousCompleted(
                    round=self.rounds.round,
                    ranks={n: i.node_rank for n, i in world.items()},
                    world_size=size,
                    restore=plan.restore,
                    restore_why=plan.why,
                    persist_step=plan.persist_step,
                    from_standby=promoted or None,
                    topology={
                        n: dict(self.nodes[n].topology) for n in world if self.nodes[n].topology
                    }
                    or None,
                    store=None if store is None else f"{url_host(store[0])}:{store[1]}",
                ),
                f"round {self.rounds.round}: {len(world)} node(s), world size {size}{taken}; "
                f"restore from {plan.where}: {plan.why}",
            )
        elif now - self.rounds.opened_at > self.settings.join_timeout:
            why = (
                f"the workers' store on the master's host (rendezvous.store: master) was not "
                f"ready within {self.settings.join_timeout:g}s (see "
                f"{self.store.log_path if self.store is not None else 'its log'})"
                if ready
                else f"{self.rounds.joined} node(s) joined round {self.rounds.round} within "
                f"{self.settings.join_timeout:g}s, at least {self.settings.min_nodes} needed"
            )
            self._finish(JobState.FAILED, f"rendezvous timed out: {why}", StopCause.JOIN_TIMEOUT)

    def _usable_replicas(self, node_id: str) -> list[ReplicaHolding]:
        """The replicas ``node_id`` keeps, but for the steps a fetch failed on (none when it
        told no replica server)."""
        node = self.nodes[node_id]
        if node.replica_port is None or not node.addr:
            return []
        kept = []
        for replica in node.replicas:
            steps = [
                s for s in replica.steps if (node_id, replica.rank, s) not in self._refused_replicas
            ]
            if steps:
                kept.append(replica.model_copy(update={"steps": steps}))
        return kept

    def _replicas_for(
        self, world: dict[str, RendezvousInfo], plan: restore.RestorePlan
    ) -> dict[str, tuple[ReplicaEndpoint | None, list[ReplicaFetch]]]:
        """Each node's buddy (the next node rank's, in a ring) and the replicas it fetches."""
        spec = self.spec.checkpoint
        if spec is None or spec.replica is None:
            return {}

        def endpoint(node_id: str) -> ReplicaEndpoint | None:
            node = self.nodes[node_id]
            if node.replica_port is None or not node.addr:
                return None
            return ReplicaEndpoint(node_id=node_id, addr=node.addr, port=node.replica_port)

        by_rank = {info.node_rank: n for n, info in world.items()}
        planned: dict[str, tuple[ReplicaEndpoint | None, list[ReplicaFetch]]] = {}
        for node_id, info in world.items():
            buddy = by_rank[(info.node_rank + 1) % len(world)]
            planned[node_id] = (endpoint(buddy) if buddy != node_id else None, [])
        for fetch in plan.fetches:
            holder = endpoint(fetch.holder)
            assert holder is not None  # only the replicas of a node with an endpoint are used
            planned[fetch.node_id][1].append(
                ReplicaFetch(
                    local_rank=fetch.local_rank,
                    rank=fetch.rank,
                    world=world[fetch.node_id].world_size,
                    step=fetch.step,
                    holder=holder,
                )
            )
        return planned

    def _maybe_grow(self) -> None:
        """Nodes standing by can enlarge a world below ``max``: re-form it with them (a
        membership change, as torchrun does; not a fault, so not charged to the budget)."""
        if self.state is not JobState.RUNNING or not self.fleet.count(NodePhase.STANDBY):
            return
        standby = [n for n in self.nodes.values() if n.phase is NodePhase.STANDBY]
        size = len(self.rounds.world)
        grown = min(size + len(standby), self.settings.max_nodes)
        grown = grown // self.settings.node_unit * self.settings.node_unit
        if not standby or grown <= size:
            return
        members = set(self.rounds.world)
        round_now = self.open_round()
        restart = Action(kind="restart", round=round_now, reason="scale up")
        for node_id in members:
            self.nodes[node_id].send(restart)
        self.timeline.emit(
            events.WorkersRestarted(
                round=round_now, cause="scale_up", standby=[n.node_id for n in standby]
            ),
            f"scale up: {len(standby)} node(s) standing by join; round {round_now}",
        )

    def _finish(self, state: JobState, reason: str, cause: StopCause) -> None:
        """End the job; ``cause`` says why when it did not succeed."""
        if self.state.terminal:
            return
        self.state = state
        self.reason = reason
        self.finished_at = time.time()
        if self.journal is not None:  # first, and whatever the disk: no resume may rerun it
            try:
                mark_ended(self.run_dir, state.value)
            except OSError as exc:
                self.could_not_write(f"job.ended-{state.value}", exc)
        self.scheduler.interrupt()  # a launch in flight (on the scheduler's thread) stops
        self._round_settled.set()
        self._next_round.set()
        for node in self.nodes.values():
            node.send(Action(kind="exit", reason=reason))
        if state is JobState.SUCCEEDED:
            self.timeline.emit(events.JobFinished(), reason)
        else:
            self.timeline.emit(events.JobStopped(cause=cause), reason)

    # -- main loop ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> None:
        try:
            handles = await self.fleet.launch(spec, self.settings.max_nodes + self.settings.standby)
        except SchedulerError:
            if not self.state.terminal:
                raise
            handles = []  # stopped while launching: the scheduler released what it started
        if self.state.terminal:  # stopped meanwhile (a signal): the job must not start again
            return
        if self.preflight.finished:
            self.open_round()
        else:  # the first round opens once the pre-flight check is done
            self.state = JobState.PREFLIGHT
        started = f"{len(handles)} node(s) requested"
        if isinstance(self.fleet.scheduler, AdmitsNodes):  # the others start outside, and join
            wanted = self.settings.min_nodes, self.settings.max_nodes
            count = str(wanted[0]) if wanted[0] == wanted[1] else "{}:{}".format(*wanted)
            started = f"{len(handles)} node(s) started here, {count} in all expected to join"
        self.timeline.emit(
            events.JobStarted(run_id=self.spec.run_id, nodes=[h.node_id for h in handles]),
            f"job {self.spec.job} started: {started}",
        )

    async def adopt(self, spec: LaunchSpec, journalled: Journalled) -> None:
        """A resumed job's nodes: the scheduler takes them over, and the replacements the
        master before this one had asked for and not seen come are asked for again."""
        handles = []
        for raw in journalled.handles.values():
            handle = NodeHandle.model_validate(raw)
            node = self.nodes.get(handle.node_id)
            if node is None or node.phase.gone:
                handle = handle.model_copy(update={"state": NodeState.LOST})
            handles.append(handle)
        await self.fleet.adopt(spec, handles, set(self.recovery.excluded))
        for node_id, exclude_host in list(self.recovery.replacing.items()):
            if node_id in self.nodes:
                self.recovery.replace(self.nodes[node_id], exclude_host)

    def node_event(self, event: NodeEvent) -> None:
        """The scheduler saw a node change: one that ended is lost (or, once the job is
        over, has exited)."""
        node = self.nodes.get(event.node_id)
        if node is None or node.phase.gone:
            return
        if event.state in (NodeState.PENDING, NodeState.RUNNING):
            return
        if self.state.terminal:
            node.phase = NodePhase.EXITED
            return
        self.recovery.node_lost(node, f"agent process ended: {event.reason or event.state.value}")

    def tick(self, now: float, monotonic: float) -> None:
        """What time alone changes: silent nodes are lost, the pre-flight check moves on, a
        round closes (or times out), a running world grows."""
        if self.state.terminal:
            return
        for node in self.fleet.silent(monotonic, but=self.preflight.busy):
            self.recovery.node_lost(node, f"no heartbeat for {self.spec.heartbeat_timeout:g}s")
        if self.state is JobState.PREFLIGHT:
            self.preflight.tick(now)
        if self.state is JobState.RUNNING:
            self.diagnosis.check_stragglers(monotonic, self.spec.heartbeat_interval)
        self._maybe_close()
        self._maybe_grow()

    def summary(self) -> Summary:
        end = self.finished_at or time.time()
        startup = None if self.first_step_at is None else self.first_step_at - self.started
        last = self.newest_step
        committed = self.checkpoints.committed_step
        return Summary(
            state=self.state.value,
            reason=self.reason,
            steps=self.steps_done,
            wall_s=end - self.started,
            startup_s=startup,
            downtime_s=self.recovery.downtime_s,
            restarts=self.restarts,
            faults=list(self.faults),
            checkpoints=self.checkpoints.committed,
            last_checkpoint=committed if committed >= 0 else None,
            unpersisted=self.checkpoints.unpersisted(last),
            skipped_checkpoints=[f"step {s}: {why}" for s, why in self.checkpoints.skipped.items()],
            started_from_scratch=self.checkpoints.scratch,
            persister_restarts=self.checkpoints.persister_restarts,
            stragglers=list(self.diagnosis.stragglers),
            preflight=self.preflight.report if self.settings.diagnosis.preflight.enabled else None,
            not_written=self._not_written(),
            failed_rank=self._failed_rank(),
            tokens=self.tokens.total,
        )

    def _failed_rank(self) -> FailedRank | None:
        """The worker failure a failed job ended on: its last fault, a worker's, unrecovered
        (not one the job got over before something else stopped it)."""
        last = self.faults[-1] if self.faults else None
        if self.state is not JobState.FAILED or last is None or last.kind != "worker_failed":
            return None
        return self.diagnosis.failed_rank if last.recovered_at is None else None

    def _not_written(self) -> list[str]:
        lost = dict(self.not_written)
        if self.timeline.unwritten:
            lost[self.timeline.path.name] = (
                f"{self.timeline.unwritten} event(s) not written: {self.timeline.write_error}"
            )
        return [f"{name}: {why}" for name, why in sorted(lost.items())]


def _ignore(event: JobEvent) -> None:
    pass


def _later(delay: float) -> asyncio.Future[None]:
    """A future done after ``delay`` seconds."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def due() -> None:
        if not done.done():
            done.set_result(None)

    loop.call_later(delay, due)
    return done
