"""The master's records of a job: its state, its nodes, its settings, and the errors of its API.

Plain data shared by the master (:mod:`planaria.master.job`) and the parts that observe the job
through :class:`planaria.master.control.JobControl`; nothing here acts.
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from planaria.diagnosis.policy import DiagnosisPolicy
from planaria.master.policy import Rules
from planaria.protocol import Action, JobSpec, MemoryHolding, ReplicaHolding
from planaria.rendezvous.api import RankPlacement
from planaria.rendezvous.builtin import StablePlacement

T = TypeVar("T", covariant=True)
U = TypeVar("U")


class BadReport(ValueError):
    """A request that is well-formed but makes no sense for the job."""


class Conflict(ValueError):
    """A valid request that the job's state does not allow now (409): a pre-flight result for
    a group the node is not in. Unlike :class:`BadReport`, the same request may be right at
    another time, so it says nothing about the sender's wire format."""


class UnknownNode(KeyError):
    """A request names a node the master does not know: it has to register first."""


class RegistrationRefused(PermissionError):
    """A registration the master will not accept: a node id it never launched, or a second
    agent claiming a node that is already registered. ``retry``: the id may still come (a
    launch is in flight), so the agent should ask again shortly."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class FencedRequest(PermissionError):
    """A request from a node the master declared lost: it must stop (its replacement may be
    training in its place)."""


class NotAttached(Exception):
    """A request from a node that has not re-attached to this (restarted) master yet."""


class Wake:
    """What ends a long poll early (an action for a node, news for the pre-flight, a round
    that closed): an event whose :meth:`wait` gives up after a while by itself. Unlike
    ``asyncio.wait_for`` on an ``asyncio.Event`` it makes no task per wait: a master holding
    10,000 nodes' heartbeats waits 10,000 times a second."""

    __slots__ = ("_prune_at", "_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] = []
        self._prune_at = 2

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def clear(self) -> None:
        self._set = False

    def waiter(self, timeout: float | None) -> asyncio.Future[None] | None:
        """A future done once set, or after at most ``timeout`` seconds (None: no limit); None
        when it is set already or ``timeout`` is up. Cancelling it only stops the wait."""
        if self._set or (timeout is not None and timeout <= 0):
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if len(self._waiters) >= self._prune_at:
            # Drop those of earlier waits that timed out or were given up, as seldom as keeps
            # the list within twice its live waiters: 10,000 nodes joining one round wait on
            # one Wake, and pruning at each would cost O(n) a join.
            self._waiters = [w for w in self._waiters if not w.done()]
            self._prune_at = 2 * len(self._waiters) + 2
        self._waiters.append(waiter)
        if timeout is not None:
            _deadlines(loop).add(loop, loop.time() + timeout, waiter)
        return waiter

    async def wait(self, timeout: float) -> bool:
        """Wait until set, at most ``timeout`` seconds; whether it is set."""
        waiter = self.waiter(timeout)
        if waiter is not None:
            await waiter
        return self._set


@dataclass(frozen=True, slots=True)
class Deferred(Generic[T]):
    """An answer deferred (a long poll's): ``then()`` gives it once ``waiting`` is done.

    A route's call answers this where it would otherwise be a coroutine that awaits a
    future and then computes its answer: the server serves it with no task and no coroutine
    of its own, which at 10,000 long polls a second is a good part of the master's time."""

    waiting: asyncio.Future[Any]
    then: Callable[[], T]

    def map(self, f: Callable[[T], U]) -> Deferred[U]:
        """The same wait, its answer passed through ``f``."""
        then = self.then
        return Deferred(self.waiting, lambda: f(then()))


class _Deadlines:
    """Waiters to wake at a time, rounded up to :data:`SLOT` seconds: one timer per slot for
    every long poll ending in it, instead of one timer per long poll."""

    def __init__(self) -> None:  # no reference to its loop: the loop's key stays weak
        self.slots: dict[int, list[asyncio.Future[None]]] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, when: float, waiter: asyncio.Future[None]
    ) -> None:
        slot = math.ceil(when / SLOT)
        waiters = self.slots.get(slot)
        if waiters is None:
            waiters = self.slots[slot] = []
            loop.call_at(slot * SLOT, self._due, slot)
        waiters.append(waiter)

    def _due(self, slot: int) -> None:
        for waiter in self.slots.pop(slot, ()):
            if not waiter.done():
                waiter.set_result(None)


SLOT = 0.005
_DEADLINES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines] = (
    weakref.WeakKeyDictionary()
)


def _deadlines(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    found = _DEADLINES.get(loop)
    if found is None:
        found = _DEADLINES[loop] = _Deadlines()
    return found


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
        return self in GONE


GONE = (NodePhase.LOST, NodePhase.EXITED)
"""The phases of a node out of the job."""


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
    wake: Wake = field(default_factory=Wake)
    """Set to end the node's long poll early: an action for it, or news for the pre-flight."""
    step: int = -1
    polled_round: int = -1
    """The last round in which the node's heartbeat long-polled (see ``Master.heartbeat``)."""
    sampled: float = float("-inf")
    """When the master last put the node's step in the timeline (monotonic clock)."""
    memory: list[MemoryHolding] = field(default_factory=list)
    replicas: list[ReplicaHolding] = field(default_factory=list)
    """Peers' steps the node keeps as replicas (``checkpoint.replica``), as it last joined."""
    replica_port: int | None = None
    """Where, at ``addr``, the node's replica server listens."""
    attached: bool = True
    """False from a restarted master's start until the node's agent re-attaches (tells what
    it runs): until then the master refuses its other requests with "re-attach first"."""
    topology: dict[str, str] = field(default_factory=dict)
    """Where the scheduler says the node stands (its handle's ``topology``): what a rank
    placement groups nodes by. A restarted master reads it back from the handles."""
    on_change: Callable[[str], None] | None = field(default=None, repr=False, compare=False)
    """Told the node's id when a field the journal keeps changes."""
    on_phase: Callable[[NodePhase, NodePhase], None] | None = field(
        default=None, repr=False, compare=False
    )
    """Told (old, new) when the node's phase changes: the fleet counts its nodes by phase."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _JOURNALLED:  # the traffic (last_seen, step): at every heartbeat
            object.__setattr__(self, name, value)
            return
        if name == "phase":
            old = self.__dict__.get("phase")
            object.__setattr__(self, name, value)
            hook = self.__dict__.get("on_phase")
            if hook is not None and old is not value:
                hook(old, value)
        else:
            object.__setattr__(self, name, value)
        if self.__dict__.get("on_change") is not None:
            self.on_change(self.node_id)  # type: ignore[misc]

    def send(self, action: Action) -> None:
        self.action = action
        self.wake.set()

    def record(self) -> dict[str, Any]:
        """The node as the journal keeps it: who it is and where it stands, not its traffic."""
        return {
            "node_id": self.node_id,
            "host": self.host,
            "phase": self.phase.value,
            "addr": self.addr,
            "pid": self.pid,
            "memory": [m.model_dump(mode="json") for m in self.memory],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Node:
        node = cls(str(record["node_id"]), str(record["host"]), NodePhase(record["phase"]))
        node.addr = str(record.get("addr") or "")
        node.pid = record.get("pid")
        node.memory = [MemoryHolding.model_validate(m) for m in record.get("memory") or []]
        return node


_JOURNALLED = frozenset({"host", "phase", "addr", "pid", "memory"})


@dataclass
class ChannelStats:
    """What the agents' channels (:mod:`planaria.master.channel`) tell the metrics."""

    open: int = 0
    """Channels open now: agents connected."""
    last_push_s: dict[str, float] = field(default_factory=dict)
    """The last burst of replies made after their request came, by the op of its first reply
    (``/actions``: a restart decided for every node; ``/rendezvous/join``: a round closed):
    from the first one made to the last one written to its socket."""
    notices_refused: int = 0
    """Notices refused (a bad heartbeat, an unknown node), each told to its agent."""


@dataclass(frozen=True)
class JobSettings:
    spec: JobSpec
    min_nodes: int
    max_nodes: int
    node_unit: int
    join_grace: float
    join_timeout: float
    diagnosis: DiagnosisPolicy = field(default_factory=DiagnosisPolicy)
    standby: int = 0
    """Nodes started beyond ``max_nodes`` that stand by, warm, for a lost node's place."""
    placement: RankPlacement[Any] = field(default_factory=StablePlacement)
    """Which member of a round gets which node rank (``rendezvous.backend``)."""
    store: str = "rank0"
    """Who hosts the workers' store (``rendezvous.store``): ``rank0`` or ``master``."""

    @property
    def rules(self) -> Rules:
        """What of these the fault policy decides with."""
        return Rules(
            max_restarts=self.spec.max_restarts,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            on_user_error=self.diagnosis.on_user_error,
            crash_loop_rounds=self.diagnosis.crash_loop_rounds,
            replace_stragglers=self.diagnosis.replace_stragglers,
            preflight_replace_stragglers=self.diagnosis.preflight.replace_stragglers,
            preflight_only=self.diagnosis.preflight.only,
        )
