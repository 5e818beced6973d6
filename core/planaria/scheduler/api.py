"""The scheduler interface: how the master gets, watches, replaces and releases nodes.

One implementation per cluster manager (``local``, ``slurm``, ``ray``, ``kubernetes``). The master
calls these methods from one thread; an implementation need not be thread-safe, except for
:meth:`Scheduler.interrupt`, which stops a launch in flight from any thread.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from planaria.errors import ConfigIssue, SchedulerError
from planaria.plugin.records import PluginKind, PluginRecord


class NodeState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"


class LaunchSpec(BaseModel):
    """What every node must run: the agent command line and its environment.

    ``command`` is an argument list, never a shell string. With ``log_dir`` each node's agent
    writes its stdout and stderr to ``<log_dir>/<node_id>.log`` (mode 0600, appended); a
    scheduler whose nodes cannot reach that directory says where their logs go instead.
    """

    model_config = ConfigDict(frozen=True)

    job: str
    command: tuple[str, ...]
    env: dict[str, str] = Field(default_factory=dict)
    log_dir: Path | None = None
    run_id: str = ""
    """The run's id: what a node puts in /dev/shm is named ``planaria-<run_id>-...``."""
    detached: bool = False
    """The nodes outlive the process that launched them: their agents stop by themselves
    once the master has been gone for its grace, and a restarted master adopts them
    (:meth:`Scheduler.adopt`). Otherwise a scheduler that can ties them to the launcher."""


class NodeHandle(BaseModel):
    """A node the scheduler created. ``node_id`` is stable for the node's life; ``host`` is
    the machine it landed on (the unit of exclusion)."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    host: str
    state: NodeState = NodeState.PENDING
    data: dict[str, str] = Field(default_factory=dict)
    """What the scheduler needs to find the node again (:meth:`Scheduler.adopt`): kept in
    the master's journal, never shown to agents."""
    topology: dict[str, str] = Field(default_factory=dict)
    """Where the node stands in the cluster's network, as labels (``{"switch": "s1"}``): a
    rank placement (``rendezvous.backend: topology``) gives nodes of one switch contiguous
    node ranks. Empty when the scheduler does not know."""


class NodeEvent(BaseModel):
    """A change of a node's state, as the cluster manager saw it."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    state: NodeState
    reason: str = ""


class SubmitRequest(BaseModel):
    """A job to hand to the cluster manager as a batch job that runs ``planaria run`` itself
    (``planaria submit``): everything a batch script needs to say about it."""

    model_config = ConfigDict(frozen=True)

    config: Path
    """The job's config file, absolute: the batch job reads it again."""
    overrides: tuple[str, ...] = ()
    """``--set PATH=VALUE`` overrides, passed on to ``planaria run``."""
    job: str
    min_nodes: int
    max_nodes: int
    standby: int = 0
    """Nodes started beyond ``max_nodes`` to stand by (``job.standby``): the allocation holds
    ``max_nodes + standby`` at least."""
    procs_per_node: int
    workdir: Path
    """The job's workdir, absolute (where it remembers what earlier runs learnt)."""
    directory: Path
    """Where the submission was made, absolute: relative paths of the config resolve here."""
    python: str
    """The interpreter that runs ``python -m planaria run`` in the batch job."""


class SubmitResult(BaseModel):
    """What a submission produced: the batch script, and the job id (none for a dry run)."""

    model_config = ConfigDict(frozen=True)

    script: str
    job_id: str | None = None


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class Scheduler(ABC, Generic[OptionsT]):
    """Base class of every scheduler plugin::

    class MyScheduler(Scheduler[MyOptions]):
        def launch(self, spec, count): ...
    """

    name: ClassVar[str] = ""
    nodes_here: ClassVar[bool] = False
    """The nodes run on this very machine, with its files and environment, so that what a
    job names (its program, its workdir) can be checked here before anything starts."""

    def __init__(self, options: OptionsT) -> None:
        self.options = options
        self._interrupted = threading.Event()

    @classmethod
    def capacity_issues(
        cls, options: OptionsT, *, nodes: int, procs_per_node: int
    ) -> list[ConfigIssue]:
        """What this scheduler cannot give a job of ``nodes`` nodes of ``procs_per_node``
        workers each, as problems of the config (``job.nodes``, ``scheduler.options.X``),
        found when it loads, before anything starts. The default: none. It may ask the
        cluster; ``planaria submit --dry-run`` and ``planaria config validate`` do not call it
        unless :attr:`nodes_here` (the nodes are this machine, which is no cluster to ask)."""
        return []

    @classmethod
    def submit(cls, options: OptionsT, request: SubmitRequest, *, dry_run: bool) -> SubmitResult:
        """Submit the job as a batch job of the cluster manager, which runs ``planaria run``
        on its allocation; with ``dry_run`` only write the batch script. Only schedulers that
        run inside an allocation have this; the default refuses."""
        raise SchedulerError(
            f"scheduler {cls.name!r} starts its nodes itself: use `planaria run` "
            f"{request.config} rather than `planaria submit`"
        )

    def interrupt(self) -> None:
        """Stop starting nodes, from any thread (the job is stopping): a :meth:`launch` or
        :meth:`replace` in flight stops before its next node, releases what it started and
        raises :class:`~planaria.errors.SchedulerError`; later ones start nothing.
        :meth:`stop` still works."""
        self._interrupted.set()

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def check_interrupted(self, what: str) -> None:
        """Raise :class:`~planaria.errors.SchedulerError` saying ``what`` cannot be done
        once :meth:`interrupt` was called."""
        if self.interrupted:
            raise SchedulerError(f"{what}: the job is stopping (the scheduler was interrupted)")

    @abstractmethod
    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Ask for ``count`` nodes, each running ``spec.command``. Returns at once; nodes start
        ``pending`` and their progress arrives through :meth:`poll`."""

    @abstractmethod
    def poll(self, timeout: float) -> list[NodeEvent]:
        """Return state changes seen since the last call, waiting at most ``timeout`` seconds
        for the first one. Never blocks longer than ``timeout``."""

    @abstractmethod
    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Release ``node_id`` and ask for a new node in its place. With ``exclude_host`` the
        new node must not land on the old node's host (diagnosed bad hardware)."""

    @abstractmethod
    def stop(self, node_ids: list[str] | None = None) -> None:
        """Stop the given nodes, or every node of the job; idempotent. No process survives."""

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Take over the nodes of a job whose master restarted: ``handles`` are every node
        the earlier master had (as :meth:`launch` and :meth:`replace` returned them, gone ones
        included), ``spec`` what they run, ``excluded`` the hosts it had excluded. From then
        on :meth:`poll`, :meth:`replace` and :meth:`stop` work on them as on nodes this
        scheduler started; one that is no longer there is reported ``lost`` by the next poll.
        A scheduler that cannot find its nodes again raises :class:`SchedulerError`."""
        raise SchedulerError(
            f"the {self.name} scheduler cannot take over the nodes of a running job, so a "
            "restarted master cannot resume it"
        )

    def excluded_hosts(self) -> set[str]:
        """Hosts this scheduler will not place nodes on any more."""
        return set()

    def node_addresses(self) -> list[str]:
        """Where this scheduler's nodes will run, known before any starts: the addresses of
        their machines, or names that resolve to them (not :attr:`NodeHandle.host`, which may
        be a label); ``[]`` when it cannot tell. A master bound to every interface tells its
        agents the address it reaches these from (:mod:`planaria.master.advertise`). Called
        from the scheduler's thread, before :meth:`launch`."""
        return []


class AdmitsNodes(ABC):
    """A scheduler capability: nodes that register although the master never launched them
    (started outside planaria, the way torchrun's are) are counted in, by
    :meth:`admit`. Called from the master's loop, not the scheduler's thread: it must not
    block, and must be safe beside the scheduler's other methods."""

    @abstractmethod
    def admit(self, node_id: str, host: str) -> NodeHandle:
        """Count the node ``node_id`` on ``host`` in, or raise
        :class:`~planaria.errors.SchedulerError` saying why not (the job is full)."""


class SchedulerRecord(PluginRecord):
    kind: ClassVar[PluginKind] = PluginKind.SCHEDULER
    well_known: ClassVar[dict[str, str]] = {
        "slurm": "planaria-slurm",
        "ray": "planaria-ray",
        "kubernetes": "planaria-kubernetes",
    }
    well_known_commands: ClassVar[frozenset[str]] = frozenset({"kubernetes"})
    """The well-known schedulers that bring commands of their own (``planaria kubernetes
    manifest``): asked for while not installed, ``planaria`` says what to install instead of
    "No such command"."""
    factory: type[Scheduler]  # type: ignore[type-arg]  # pydantic rejects type[X[Any]]
    commands: Any = None
    """The scheduler's own commands, a ``typer.Typer`` run as ``planaria <name> ...`` (the
    kubernetes scheduler's ``planaria kubernetes manifest``); loaded only when asked for."""


def poll_events(
    timeout: float, take: Callable[[], list[NodeEvent]], sleep: Callable[[float], None]
) -> list[NodeEvent]:
    """The body of a :meth:`Scheduler.poll`: ``take()`` (look at the nodes, return the events
    seen) until it returns some, sleeping with ``sleep(remaining)`` in between, and never past
    ``timeout`` seconds."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        events = take()
        if events:
            return events
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return []
        sleep(remaining)
