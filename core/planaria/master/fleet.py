"""The job's nodes: the registry agents register into, their heartbeats, and every scheduler
call, on one thread of its own.

A local scheduler's child processes are tied to the thread that started them, and a cluster
manager's client may block for seconds: scheduler calls never run on the master's loop.
Replacements and releases run as background tasks; the job's end waits for them, so nothing of
the job writes to its timeline after it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from planaria import events
from planaria.background import Running
from planaria.errors import SchedulerError
from planaria.log import get_logger
from planaria.master.journal import Journal
from planaria.master.state import GONE, Node, NodePhase, RegistrationRefused
from planaria.master.timeline import Timeline
from planaria.protocol import Action, NodeStatus, RegisterRequest
from planaria.scheduler.api import AdmitsNodes, LaunchSpec, NodeEvent, NodeHandle, Scheduler

log = get_logger("master")

T = TypeVar("T")

SCAN_EVERY = 0.25
"""Seconds between two looks for silent nodes."""


class Fleet:
    def __init__(
        self,
        scheduler: Scheduler[Any],
        timeline: Timeline,
        heartbeat_interval: float,
        heartbeat_timeout: float,
    ) -> None:
        self.scheduler = scheduler
        self.timeline = timeline
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes: dict[str, Node] = {}
        self.launching = 0
        """Launches in flight: their agents may register before the scheduler answers."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")
        self._tasks: Running[asyncio.Future[None]] = Running()
        self._replacing = 0
        self.journal: Journal | None = None
        """Told of every node handle the scheduler gives, and of changes to the nodes."""
        self.grace = heartbeat_timeout
        """How long every node may be silent at once before they count as lost: a master
        that hears from nobody may itself be cut off (``master.grace``)."""
        self._isolated_since: float | None = None
        self._excused: set[str] = set()
        """Nodes silent while no node was heard: lost only past the grace."""
        self._by_phase: Counter[NodePhase] = Counter()
        self._scanned = -float("inf")
        self._waiting: set[str] = set()
        """Nodes started outside whose new agent waits for the earlier one to be lost."""

    def add(self, node: Node) -> Node:
        """Count ``node`` in; the journal hears of its changes from now on."""
        old = self.nodes.get(node.node_id)
        if old is not None:
            old.on_phase = None
            self._moved(old.phase, None)
        self.nodes[node.node_id] = node
        node.on_phase = self._moved
        self._moved(None, node.phase)
        if self.journal is not None:
            node.on_change = self.journal.node_changed
            self.journal.node_changed(node.node_id)
        return node

    def _handles(self, handles: list[NodeHandle]) -> None:
        if self.journal is not None:
            self.journal.handles([h.model_dump(mode="json") for h in handles])

    async def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Hand a restarted master's nodes to the scheduler (:meth:`Scheduler.adopt`)."""
        await self.call(self.scheduler.adopt, spec, handles, excluded)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Ask for ``count`` nodes running ``spec``; they are known (``launched``) from then on."""
        self.launching += 1
        try:
            handles = await self.call(self.scheduler.launch, spec, count)
        finally:
            self.launching -= 1
        self._handles(handles)
        for handle in handles:
            self.add(Node(handle.node_id, handle.host, topology=dict(handle.topology)))
        return handles

    def replace(
        self, node: Node, *, exclude_host: bool, after: Awaitable[None] | None = None
    ) -> Awaitable[Node]:
        """Ask for a new node in ``node``'s place (once ``after`` is done, when given):
        awaiting it gives the node (or raises the scheduler's error). It counts as coming
        (:meth:`replacing`) from this call on, not from when the scheduler's thread gets to
        it."""
        self._replacing += 1

        async def ask() -> Node:
            try:
                if after is not None:
                    await after
                handle = await self.call(
                    self.scheduler.replace, node.node_id, exclude_host=exclude_host
                )
                self._handles([handle])
                new = self.add(Node(handle.node_id, handle.host, topology=dict(handle.topology)))
            finally:
                self._replacing -= 1
            return new

        return ask()

    async def release(self, node: Node) -> None:
        """Stop ``node``; no other comes in its place. A failure is only logged: the node is
        out of the job either way."""
        try:
            await self.call(self.scheduler.stop, [node.node_id])
        except Exception as exc:
            log.warning("stopping a node failed", node=node.node_id, error=str(exc))

    async def poll(self) -> list[NodeEvent]:
        return await self.call(self.scheduler.poll, 0.0)

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (a replacement, a release) on the loop; :meth:`close` waits for it."""
        self._tasks.start(work)

    def replacing(self) -> int:
        """Replacements asked of the scheduler that have not come back yet."""
        return self._replacing

    def _moved(self, old: NodePhase | None, new: NodePhase | None) -> None:
        """A node changed phase: the counts by phase follow, so that no join, heartbeat or
        tick has to count the nodes of a large job one by one."""
        if old is not None:
            self._by_phase[old] -= 1
        if new is not None:
            self._by_phase[new] += 1

    def count(self, phase: NodePhase) -> int:
        """Nodes in ``phase`` now."""
        return self._by_phase[phase]

    def alive(self, but: str | None = None) -> int:
        """Nodes in the job (not gone), ``but`` one not counted."""
        gone = sum(self._by_phase[p] for p in GONE)  # called per join: no walk of NodePhase
        node = self.nodes.get(but) if but is not None else None
        return len(self.nodes) - gone - (1 if node is not None and not node.phase.gone else 0)

    def settled(self) -> bool:
        """Every node is out of the job, or was never started (a launch the job's end cut)."""
        return all(n.phase.gone or n.phase is NodePhase.LAUNCHED for n in self.nodes.values())

    def statuses(self, rank_of: Mapping[str, int]) -> list[NodeStatus]:
        """Every node as ``/v1/status`` shows it; ``rank_of``: the running world's ranks."""
        return [
            NodeStatus(
                node_id=n.node_id,
                host=n.host,
                state=n.phase.value,
                node_rank=rank_of.get(n.node_id),
                step=n.step,
                topology=dict(n.topology),
            )
            for n in self.nodes.values()
        ]

    def register(self, request: RegisterRequest) -> Node:
        """Accept an agent for a node this job launched, once. The token alone does not make
        a node: an id the scheduler never reported is refused (while a launch is in flight,
        with "ask again": its agent may be faster than the scheduler's answer), and so is a
        second agent for a registered node. Every refusal is in the timeline. With a scheduler
        that admits nodes started outside, an unknown id is counted in, and a second agent for
        a registered node asks again until the first is declared lost (the same node started
        again)."""
        node = self.nodes.get(request.node_id)
        if isinstance(self.scheduler, AdmitsNodes) and (node is None or node.phase.gone):
            node = self._admit(request)
        if node is None:
            if self.launching or self._replacing:
                raise RegistrationRefused(
                    f"node {request.node_id!r} is not known yet; ask again", retry=True
                )
            raise self._refuse(request, "this job never launched a node of that id")
        if node.phase.gone:
            raise self._refuse(request, f"the node is {node.phase.value}: it is out of the job")
        if node.phase is not NodePhase.LAUNCHED:
            if (node.pid, node.host, node.addr) == (request.pid, request.host, request.addr):
                node.last_seen = time.monotonic()  # the same agent asking again: its reply
                return node  # was lost on the way
            if isinstance(self.scheduler, AdmitsNodes):
                # A node started outside, started again (srun --requeue) before its old agent
                # was found silent: it takes the node's place once that one is declared lost.
                if request.node_id not in self._waiting:
                    self._waiting.add(request.node_id)
                    log.warning(
                        "a node registers again while its earlier agent is still counted in: "
                        "it waits until that one is declared lost",
                        node=request.node_id,
                        pid=request.pid,
                        earlier_pid=node.pid,
                    )
                raise RegistrationRefused(
                    f"node {request.node_id!r} is registered already (agent pid {node.pid} on "
                    f"{node.host}); ask again: this agent takes its place once that one is "
                    "declared lost",
                    retry=True,
                )
            raise self._refuse(
                request,
                f"the node is registered already (agent pid {node.pid} on {node.host})",
            )
        self._waiting.discard(request.node_id)
        node.addr = request.addr
        node.pid = request.pid
        node.phase = NodePhase.REGISTERED
        node.last_seen = time.monotonic()
        log.info(
            "node registered",
            node=request.node_id,
            host=request.host,
            addr=request.addr,
            pid=request.pid,
        )
        return node

    def _admit(self, request: RegisterRequest) -> Node:
        """A node started outside planaria registers: the scheduler counts it in (a node
        that was lost and came back starts afresh) or says why the job has no room."""
        scheduler = self.scheduler
        assert isinstance(scheduler, AdmitsNodes)
        try:
            handle = scheduler.admit(request.node_id, request.host)
        except SchedulerError as exc:
            raise self._refuse(request, str(exc)) from None
        self._handles([handle])
        return self.add(Node(handle.node_id, handle.host, topology=dict(handle.topology)))

    def _refuse(self, request: RegisterRequest, why: str) -> RegistrationRefused:
        message = (
            f"registration of node {request.node_id!r} (host {request.host}, pid {request.pid}) "
            f"refused: {why}"
        )
        log.warning("registration refused", node=request.node_id, why=why)
        self.timeline.emit(
            events.RegistrationRefused(host=request.host, pid=request.pid, why=why),
            message,
            node=request.node_id,
        )
        return RegistrationRefused(message)

    # -- heartbeats ---------------------------------------------------------------------------

    def wait_for_action(
        self, node: Node, hold: float | None, *, stopping: bool
    ) -> asyncio.Future[None] | None:
        """What a node's wait for its next action waits for: an action for it, at most ``hold``
        seconds (None: no limit); None when there is one already (or the job is stopping).
        :meth:`next_action` takes it."""
        if node.action is not None or stopping:
            return None
        node.wake.clear()
        return node.wake.waiter(hold)

    def next_action(self, node: Node) -> Action | None:
        """The action due to ``node``, taken: None when there is none."""
        action, node.action = node.action, None
        return action

    def silent(self, now: float, but: Callable[[str], bool]) -> list[Node]:
        """Registered nodes in the job not heard from for the heartbeat timeout (``now`` on the
        monotonic clock), except those ``but`` excuses. A node still pending is the scheduler's
        business; the rendezvous timeout covers one that never comes.

        The nodes are looked at a few times a second (:data:`SCAN_EVERY`), not at every
        tick: a heartbeat timeout is seconds long, and a job of 10,000 nodes would otherwise
        spend its master's time counting them."""
        if now - self._scanned < SCAN_EVERY:
            return []
        self._scanned = now
        # One pass, and no call per node but for a silent one: in a profile at 3,000 nodes the
        # scan of three passes was 7% of the master's busy time.
        timeout = self.heartbeat_timeout
        unwatched = (NodePhase.LAUNCHED, *GONE)  # not started yet, or out of the job
        silent = []
        heard = -math.inf
        for node in self.nodes.values():
            if node.phase in unwatched:
                continue
            seen = node.last_seen
            if seen > heard:
                heard = seen
            if now - seen > timeout and not but(node.node_id):
                silent.append(node)
        if heard == -math.inf:
            heard = now
        # A node that is alive is heard about every heartbeat interval (its long poll comes
        # back at once): when none was heard for a few intervals, this master may be the one
        # cut off. The agents keep training for the grace; so does the master before it calls
        # any of them lost.
        # A node silent while the master was cut off keeps that excuse for the grace, also
        # once others are heard again: its requests may take longer to come through.
        quiet = min(max(2 * self.heartbeat_interval, 1.0), self.heartbeat_timeout)
        ids = {n.node_id for n in silent}
        self._excused &= ids
        if not silent or now - heard <= quiet:
            self._isolated_since = None
            return [n for n in silent if n.node_id not in self._excused or self._past_grace(n, now)]
        self._excused |= ids
        if self._isolated_since is None:
            self._isolated_since = now
            log.warning(
                "no node heard lately: this master may be cut off; "
                "waiting for the grace before any is called lost",
                nodes=len(silent),
                grace=self.grace,
            )
            self.timeline.emit(
                events.MasterIsolated(nodes=len(silent), grace=self.grace),
                f"no node heard for {now - heard:.1f}s, {len(silent)} silent past the heartbeat "
                f"timeout: the master may be cut off; waiting up to {self.grace:g}s "
                "(master.grace) before calling them lost",
            )
        return [n for n in silent if self._past_grace(n, now)]

    def _past_grace(self, node: Node, now: float) -> bool:
        return now - node.last_seen > self.grace

    def stall_threshold(self) -> float:
        """A gap between two ticks beyond which the master counts itself as having stalled."""
        return max(0.5, min(self.heartbeat_interval, self.heartbeat_timeout / 4))

    def renew_after_stall(self, gap: float) -> None:
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
        if gap > self.heartbeat_interval * 2:
            self.timeline.emit(
                events.MasterStalled(seconds=round(gap, 3)),
                f"the master stalled for {gap:.1f}s; every node's heartbeat window renewed",
            )

    async def close(self) -> None:
        """Wait for replacements in flight, stop every node, end the scheduler's thread."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.call(self.scheduler.stop, None)
        self._executor.shutdown(wait=True)
