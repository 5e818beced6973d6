"""The scheduler engine: what every scheduler does alike, written once; a backend writes the rest.

A scheduler built on :class:`EngineScheduler` keeps a table of its nodes (:class:`EngineNode`:
id, host, state, the backend's own data) and implements the public
:class:`~planaria.scheduler.api.Scheduler` methods (launch, poll, replace, stop,
excluded_hosts) as templates. What differs from one cluster manager to the next is four methods
of the backend (a subclass), in the shape of a reconciler over a small instance provider:

``place(node, avoid, replacing) -> str | None``
    Choose a host for ``node``, never one in ``avoid``. ``None``: none is free now, the node
    waits ``pending`` (host ``""``) and is placed again at every :meth:`~EngineScheduler.poll`.
    No host will ever do (every host is excluded, the cluster is too small): raise
    :class:`Unplaceable` saying why; the engine names what could not be done. ``replacing`` is
    the node a :meth:`~EngineScheduler.replace` lets go of: its place counts as free. May
    raise :class:`~planaria.errors.SchedulerError` (the cluster cannot be asked).
``start(node) -> DataT``
    Start the agent of ``node`` (``node.node_id``, ``node.spec``) on ``node.host`` (a backend
    whose cluster manager picks the machine, as Kubernetes does, may have ``place`` return a
    label and set ``node.host`` later, from ``observe``; ``node.avoid`` is what to keep it
    off) and return what the backend needs to watch and stop it; it becomes ``node.data``.
    Raise :class:`~planaria.errors.SchedulerError` when it cannot start. A backend whose nodes
    run as soon as they exist says so with :meth:`~EngineScheduler.report` (``running``).
``terminate(nodes, grace)``
    Stop the nodes' agents and whatever they started (SIGTERM, SIGKILL after ``grace``
    seconds, or the cluster manager's equivalent), and return once they are gone. Called with
    started nodes only, but maybe ones that ended or were terminated already: skip those.
``observe() -> Iterable[NodeEvent]``
    What changed since the last call: a node that runs, ended (see :func:`exit_event`, the one
    wording of exit codes and signals), or was lost. Must not block. The engine drops events
    of nodes the caller let go of, and any after a node's terminal one (a node ends once).

Optional hooks, with defaults: :meth:`~EngineScheduler.check_spec` and
:meth:`~EngineScheduler.check_room` (refuse a launch before anything starts),
:meth:`~EngineScheduler.wait` (sleep until something may change; pidfds, a watch),
:meth:`~EngineScheduler.handle_data` (what :meth:`~planaria.scheduler.api.Scheduler.adopt` needs
later), :meth:`~EngineScheduler.retire` (what replacing does to the old node),
:meth:`~EngineScheduler.on_exclude` (drain, cordon), :meth:`~EngineScheduler.after_stop`
(clean up after the job). ``adopt`` and ``node_addresses`` stay the plain
:class:`~planaria.scheduler.api.Scheduler` methods: a backend that can, overrides them, with
:meth:`~EngineScheduler.add_adopted` to put the nodes it finds in the table.

The engine's promises, which :class:`~planaria.testing.SchedulerConformance` checks:

- Node ids are ``node-0``, ``node-1``, ... in launch order, never reused once handed out.
- An id the scheduler never gave out is a :class:`~planaria.errors.SchedulerError` naming it.
- A launch is all or nothing: when a node cannot be placed or started, or
  :meth:`~planaria.scheduler.api.Scheduler.interrupt` is called between two nodes, what the
  launch started is terminated (no grace), its ids are given out again, and the error raised.
- A replace that finds no host for the new node changes nothing (the old node runs on);
  otherwise the old node's host is excluded when asked, the old node is retired, and the
  new one started (or left waiting for a host).
- Excluded hosts are never passed to ``place`` as allowed, for launches and replacements.
- A node the caller stopped or replaced produces no further event; each node ends once.

The thread rule: a backend whose nodes die with the thread that started them
(``PR_SET_PDEATHSIG``) sets :attr:`EngineScheduler.owner_thread` to say so; then every method
that starts nodes (launch, replace, adopt, and a poll that starts a waiting node) must be
called from the thread of the first such call, for as long as the scheduler lives, and a call
from another raises :class:`~planaria.errors.SchedulerError`, the first thread being alive or
not. Nothing here is thread-safe, except :meth:`~planaria.scheduler.api.Scheduler.interrupt`.

Why one module: the engine is one idea, the node table and the templates that keep it true;
split, each template would have to be read beside the table it changes. Half of it is this
contract and the hooks' docs.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from planaria import process
from planaria.errors import SchedulerError
from planaria.log import get_logger
from planaria.scheduler.api import (
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    OptionsT,
    Scheduler,
    poll_events,
)

log = get_logger("scheduler.engine")

DataT = TypeVar("DataT")

TERMINAL = frozenset({NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST})


class Unplaceable(SchedulerError):
    """No host will ever take the node (raised by a backend's ``place``); the message says
    why, the engine prefixes what could not be done."""


def exit_event(node_id: str, returncode: int, *, who: str = "", shell: bool = False) -> NodeEvent:
    """How a node's agent (or the process that runs it) ended, as an event.

    Exit 0: ``succeeded`` (no verdict on the job, which may have failed); another code:
    ``failed``, "exit code N"; killed by a signal (a negative ``returncode``, as
    :mod:`subprocess` gives it): ``lost``, "killed by SIGKILL", after ``who`` when the process
    is not the agent itself (``who="srun"``). With ``shell`` a code above 128 is how a launcher
    (srun, a shell, a container runtime) says the agent it ran died of signal ``code - 128``:
    ``lost``, "the agent killed by SIGKILL".
    """
    if returncode == 0:
        return NodeEvent(node_id=node_id, state=NodeState.SUCCEEDED)
    if returncode < 0 or (shell and returncode > 128):
        number = -returncode if returncode < 0 else returncode - 128
        killer = who if returncode < 0 else "the agent"
        reason = f"{killer} killed by {process.signal_name(number)}".strip()
        return NodeEvent(node_id=node_id, state=NodeState.LOST, reason=reason)
    return NodeEvent(node_id=node_id, state=NodeState.FAILED, reason=f"exit code {returncode}")


@dataclass(eq=False)
class EngineNode(Generic[DataT]):
    """One node in the engine's table."""

    node_id: str
    spec: LaunchSpec
    host: str = ""
    """Where it runs; ``""`` while it waits for a host."""
    data: DataT | None = None
    """What the backend's ``start`` returned; None until it started."""
    state: NodeState = NodeState.PENDING
    released: bool = False
    """Stopped or replaced: the caller let go of it and hears nothing more about it."""
    avoid: frozenset[str] = frozenset()
    """The hosts the node must not be placed on (those excluded when it was asked for): what
    ``place`` was given, kept for a waiting node's next try and for a backend whose cluster
    manager places the node itself (``start`` writes it as anti-affinity)."""

    @property
    def started(self) -> bool:
        return self.data is not None

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    @property
    def waiting(self) -> bool:
        return self.data is None and not self.released and self.state is NodeState.PENDING


class EngineScheduler(Scheduler[OptionsT], Generic[OptionsT, DataT]):
    """A scheduler whose bookkeeping the engine does; see the module docstring."""

    owner_thread: ClassVar[str] = ""
    """Why nodes must be started from one thread (they die with it); empty: no such rule."""
    wait_interval: ClassVar[float] = 0.05
    """How long the default :meth:`wait` sleeps at most: how soon a change is seen."""

    def __init__(self, options: OptionsT) -> None:
        super().__init__(options)
        self.nodes: dict[str, EngineNode[DataT]] = {}
        """Every node handed out, by id, in launch order."""
        self._events: list[NodeEvent] = []
        self._excluded: dict[str, str] = {}
        self._next_number = 0
        self._owner: threading.Thread | None = None

    # -- the backend ------------------------------------------------------------------------

    @abstractmethod
    def place(
        self, node: EngineNode[DataT], avoid: frozenset[str], replacing: EngineNode[DataT] | None
    ) -> str | None:
        """A host for ``node`` outside ``avoid``, None to wait, or :class:`Unplaceable`."""

    @abstractmethod
    def start(self, node: EngineNode[DataT]) -> DataT:
        """Start ``node``'s agent on ``node.host``; return what watches and stops it."""

    @abstractmethod
    def terminate(self, nodes: list[EngineNode[DataT]], grace: float) -> None:
        """Stop these started nodes (ended ones too: skip them) and return once gone."""

    @abstractmethod
    def observe(self) -> Iterable[NodeEvent]:
        """What changed since the last call, without blocking."""

    # -- optional hooks ---------------------------------------------------------------------

    def check_spec(self, spec: LaunchSpec) -> None:
        """Refuse a spec no node can run (called before anything starts, even for 0 nodes)."""
        if not spec.command:
            raise SchedulerError("cannot launch nodes: the launch command is empty")

    def check_room(self, count: int) -> None:
        """Refuse ``count`` more nodes when they cannot all be had (before any starts)."""

    def wait(self, remaining: float) -> None:
        """Sleep until a node may have changed, at most ``remaining`` seconds."""
        time.sleep(min(remaining, self.wait_interval))

    def handle_data(self, node: EngineNode[DataT]) -> dict[str, str]:
        """What a started node's handle carries for :meth:`adopt` (kept in the journal)."""
        return {}

    def handle_topology(self, node: EngineNode[DataT]) -> dict[str, str]:
        """Where the node stands in the cluster's network (``{"switch": "s1"}``), for a
        rank placement; empty when the scheduler does not know."""
        return {}

    def retire(self, node: EngineNode[DataT]) -> None:
        """What :meth:`replace` does with the node it lets go of: terminate it."""
        self.terminate([node], self.stop_grace)

    def on_exclude(self, host: str, why: str) -> None:
        """A host was excluded (once per host): tell the cluster manager, if it listens."""

    def after_stop(self, nodes: list[EngineNode[DataT]], everything: bool) -> None:
        """Called after :meth:`stop` terminated ``nodes``; ``everything``: the job ends."""

    @property
    def stop_grace(self) -> float:
        """The grace of a stop: the ``stop_grace`` option, when the backend has one."""
        return float(getattr(self.options, "stop_grace", 0.0))

    # -- what backends call ----------------------------------------------------------------

    def node(self, node_id: str) -> EngineNode[DataT]:
        """The node ``node_id``, or :class:`SchedulerError` when this scheduler never gave
        that id out."""
        node = self.nodes.get(node_id)
        if node is None:
            raise SchedulerError(
                f"unknown node {node_id!r}: this {self.name} scheduler never started it"
            )
        return node

    def report(self, node: EngineNode[DataT], state: NodeState, reason: str = "") -> None:
        """Tell the next poll that ``node`` changed (dropped when the caller let go of it, or
        when it already ended)."""
        self._apply(NodeEvent(node_id=node.node_id, state=state, reason=reason))

    def exclude(self, host: str, why: str) -> None:
        """Place no node on ``host`` any more."""
        if host in self._excluded:
            return
        self._excluded[host] = why
        log.warning("host excluded", scheduler=self.name, host=host, why=why)
        self.on_exclude(host, why)

    def live(self) -> list[EngineNode[DataT]]:
        """Started nodes the caller still holds that have not ended."""
        return [n for n in self.nodes.values() if n.started and not n.released and not n.ended]

    def keep_excluded(
        self, hosts: Iterable[str], why: str = "excluded before the master restarted"
    ) -> None:
        """Exclude the hosts a master before this one excluded (for :meth:`adopt`, or a run
        before this one that remembered them): they were reported to the cluster manager then,
        so :meth:`on_exclude` is not called again."""
        for host in hosts:
            self._excluded.setdefault(host, why)

    def exclusions(self) -> dict[str, str]:
        """The excluded hosts, each with why: for a backend's messages."""
        return dict(self._excluded)

    def add_adopted(
        self, handle: NodeHandle, spec: LaunchSpec, data: DataT | None
    ) -> EngineNode[DataT]:
        """Put a node a master before this one had in the table (for :meth:`adopt`): running
        when ``data`` is given, waiting for a host otherwise, lost when its handle says so.
        Later ids follow the highest one adopted."""
        number = handle.node_id.removeprefix("node-")
        if number.isdigit():
            self._next_number = max(self._next_number, int(number) + 1)
        node: EngineNode[DataT] = EngineNode(handle.node_id, spec, handle.host, data)
        if handle.state is NodeState.LOST:
            node.state = NodeState.LOST  # it ended before: nothing more is said of it
        elif data is not None:
            node.state = NodeState.RUNNING
        else:
            node.host = ""
            node.avoid = frozenset(self._excluded)
        self.nodes[node.node_id] = node
        return node

    def check_thread(self) -> None:
        """The thread rule (module docstring); nothing when :attr:`owner_thread` is empty."""
        if not self.owner_thread:
            return
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        elif self._owner is not current:
            what = (
                "has exited, which killed the nodes it started"
                if not self._owner.is_alive()
                else "must stay the only one"
            )
            raise SchedulerError(
                f"the {self.name} scheduler starts processes from one long-lived thread, "
                f"because {self.owner_thread}: called from {current.name!r}, but "
                f"{self._owner.name!r} {what}"
            )

    # -- the Scheduler interface -----------------------------------------------------------

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Place and start ``count`` nodes, all or nothing; those without a free host wait
        ``pending`` and start from a later :meth:`poll`."""
        if count < 0:
            raise SchedulerError(f"cannot launch {count} nodes: the count must be 0 or more")
        self.check_thread()
        self.check_spec(spec)
        if count == 0:
            return []
        self.check_interrupted("cannot launch nodes")
        self.check_room(count)
        first = self._next_number
        made: list[EngineNode[DataT]] = []
        avoid = frozenset(self._excluded)
        try:
            for done in range(count):
                self.check_interrupted(f"launching stopped after {done} of {count} nodes")
                node: EngineNode[DataT] = EngineNode(self._new_id(), spec)
                made.append(node)
                try:
                    host = self.place(node, avoid, None)
                except Unplaceable as exc:
                    raise SchedulerError(f"cannot launch nodes: {exc}") from None
                self._add(node, host, avoid)
        except BaseException:
            self._release(made)
            self.terminate([n for n in made if n.started], 0.0)
            for node in made:
                self.nodes.pop(node.node_id, None)
            self._next_number = first  # nothing was started: the numbering goes on
            raise
        return [self._handle(n) for n in made]

    def poll(self, timeout: float) -> list[NodeEvent]:
        """State changes since the last call, in the order seen; waits at most ``timeout``
        seconds for the first."""
        return poll_events(timeout, self._take, self.wait)

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Let ``node_id`` go (:meth:`retire`) and start a node with a new id and the same
        spec; with ``exclude_host`` its host is excluded from now on. No host for the new
        node, or after :meth:`interrupt`: :class:`SchedulerError`, changing nothing."""
        self.check_thread()
        self.check_interrupted(f"cannot replace {node_id}")
        old = self.node(node_id)
        if old.released:
            raise SchedulerError(f"cannot replace {node_id}: it was already stopped or replaced")
        if old.waiting:  # never started: the new node simply takes its place
            self._release([old])
            new = EngineNode[DataT](self._new_id(), old.spec)
            self._add(new, None, frozenset(self._excluded))
            return self._handle(new)
        avoid = frozenset(self._excluded)
        if exclude_host and old.host:
            avoid |= {old.host}
        new = EngineNode(self._new_id(), old.spec)
        try:
            host = self.place(new, avoid, old)
        except BaseException as exc:
            self._next_number -= 1
            if isinstance(exc, Unplaceable):
                raise SchedulerError(f"cannot replace {node_id}: {exc}") from None
            raise
        if exclude_host and old.host:
            self.exclude(old.host, f"node {node_id} was diagnosed faulty")
        self._release([old])
        if old.started:
            self.retire(old)
        try:
            self._add(new, host, avoid)
        except BaseException:
            self.nodes.pop(new.node_id, None)
            raise
        if host is None:
            log.info("node replacement waits for a host", node=node_id, replacement=new.node_id)
        else:
            log.info("node replaced", node=node_id, replacement=new.node_id, host=host)
        return self._handle(new)

    def stop(self, node_ids: list[str] | None = None) -> None:
        """Terminate the given nodes (within the stop grace), or every node; those waiting for
        a host never start. Stopped nodes produce no further events. Stopping a node again is
        a no-op; an id this scheduler never gave out is an error."""
        if node_ids is None:
            targets = list(self.nodes.values())
        else:
            targets = [self.node(node_id) for node_id in dict.fromkeys(node_ids)]
        self._release(targets)
        self.terminate([n for n in targets if n.started], self.stop_grace)
        self.after_stop(targets, node_ids is None)

    def excluded_hosts(self) -> set[str]:
        return set(self._excluded)

    # -- the engine's own -------------------------------------------------------------------

    def _new_id(self) -> str:
        node_id = f"node-{self._next_number}"
        self._next_number += 1
        return node_id

    def _add(self, node: EngineNode[DataT], host: str | None, avoid: frozenset[str]) -> None:
        """Put ``node`` in the table and start it on ``host``, or leave it waiting."""
        self.nodes[node.node_id] = node
        node.avoid = avoid
        if host is None:
            return
        node.host = host
        node.data = self.start(node)

    def _handle(self, node: EngineNode[DataT]) -> NodeHandle:
        data = self.handle_data(node) if node.started else {}
        return NodeHandle(
            node_id=node.node_id, host=node.host, data=data, topology=self.handle_topology(node)
        )

    def _release(self, nodes: Iterable[EngineNode[DataT]]) -> None:
        ids = set()
        for node in nodes:
            node.released = True
            ids.add(node.node_id)
        self._events = [e for e in self._events if e.node_id not in ids]

    def _apply(self, event: NodeEvent) -> None:
        node = self.nodes.get(event.node_id)
        if node is None or node.released or node.state in TERMINAL:
            return
        node.state = event.state
        self._events.append(event)

    def _take(self) -> list[NodeEvent]:
        for event in self.observe():
            self._apply(event)
        self._start_waiting()
        events, self._events = self._events, []
        return events

    def _start_waiting(self) -> None:
        """Start the nodes that wait for a host, in order, while hosts are free."""
        for node in [n for n in self.nodes.values() if n.waiting]:
            if self.interrupted:
                return
            self.check_thread()
            try:
                host = self.place(node, node.avoid, None)
                if host is None:
                    return
                node.host = host
                node.data = self.start(node)
            except SchedulerError as exc:
                self.report(node, NodeState.FAILED, f"cannot start: {exc}")
