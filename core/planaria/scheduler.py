"""The scheduler interface: how the master gets, watches, replaces and releases nodes.

One implementation per cluster manager (``local``, ``slurm``, ``ray``, ``kubernetes``). The master
calls these methods from one thread; an implementation need not be thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field


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


class NodeHandle(BaseModel):
    """A node the scheduler created. ``node_id`` is stable for the node's life; ``host`` is
    the machine it landed on (the unit of exclusion)."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    host: str
    state: NodeState = NodeState.PENDING


class NodeEvent(BaseModel):
    """A change of a node's state, as the cluster manager saw it."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    state: NodeState
    reason: str = ""


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class Scheduler(ABC, Generic[OptionsT]):
    """Base class of every scheduler plugin::

    class MyScheduler(Scheduler[MyOptions]):
        def launch(self, spec, count): ...
    """

    name: ClassVar[str] = ""

    def __init__(self, options: OptionsT) -> None:
        self.options = options

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

    def excluded_hosts(self) -> set[str]:
        """Hosts this scheduler will not place nodes on any more."""
        return set()
