"""The rendezvous interface: how nodes agree on a world (who is in, with which rank).

Modelled on ``torch.distributed.elastic.rendezvous.RendezvousHandler``, with typed options and
typed results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict


class NodeInfo(BaseModel):
    """A node asking to join: its id, its host and how many workers it runs."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    host: str
    local_world_size: int


class RendezvousInfo(BaseModel):
    """What a node gets when a round closes: enough to set torch.distributed's environment."""

    model_config = ConfigDict(frozen=True)

    round: int
    node_rank: int
    num_nodes: int
    rank_offset: int
    """Global rank of this node's local rank 0."""
    world_size: int
    master_addr: str
    master_port: int


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class RendezvousHandler(ABC, Generic[OptionsT]):
    """Base class of every rendezvous backend."""

    name: ClassVar[str] = ""

    def __init__(self, options: OptionsT, *, min_nodes: int, max_nodes: int, node_unit: int = 1):
        self.options = options
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.node_unit = node_unit

    @abstractmethod
    def next_rendezvous(self, node: NodeInfo, timeout: float) -> RendezvousInfo:
        """Join the next round and block until it closes. Raises
        :class:`~planaria.errors.RendezvousTimeoutError` if too few nodes come within
        ``timeout`` and :class:`~planaria.errors.RendezvousClosedError` once the job ends."""

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the job is over and no round will form again."""

    @abstractmethod
    def set_closed(self) -> None:
        """Close the rendezvous: waiting and future joiners get ``RendezvousClosedError``."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join a new round (a running world may grow to take them)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what this handler holds (connections, stores)."""
