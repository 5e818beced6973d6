"""The ``master`` rendezvous backend (the default): the job master forms the rounds.

A store on a training node dies with the node, and its ranks come out in arrival order; the
master outlives nodes and keeps ranks stable. This is the node's side: it asks the master to
join and waits for the round to close.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from planaria.errors import RendezvousClosedError, RendezvousError, RendezvousTimeoutError
from planaria.plugin import hookimpl
from planaria.plugin.records import RendezvousBackendRecord
from planaria.protocol import (
    API_PREFIX,
    MASTER_ENV,
    TOKEN_ENV,
    JoinReply,
    JoinRequest,
    MemoryHolding,
)
from planaria.rendezvous import NodeInfo, RendezvousHandler, RendezvousInfo


class MasterRendezvousOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MasterRendezvous(RendezvousHandler[MasterRendezvousOptions]):
    """Joins rounds through the master API: at ``url`` with ``token``, by default those of
    ``PLANARIA_MASTER`` and ``PLANARIA_TOKEN``."""

    def __init__(
        self,
        options: MasterRendezvousOptions,
        *,
        min_nodes: int,
        max_nodes: int,
        node_unit: int = 1,
        url: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(options, min_nodes=min_nodes, max_nodes=max_nodes, node_unit=node_unit)
        self._url = os.environ.get(MASTER_ENV, "") if url is None else url
        self._token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._closed = False
        self.restart_count = 0
        self.addr = ""
        self.port = 0
        self.last_step = -1
        self.memory: list[MemoryHolding] = []
        self.restore = "storage"
        self.persist_step: int | None = None

    def offer(
        self, addr: str, port: int, last_step: int = -1, memory: list[MemoryHolding] | None = None
    ) -> None:
        """The address and free port this node offers in case it gets node rank 0, the last
        step its workers completed (the master counts the steps a fault cost), and the flash
        checkpoint steps its shared memory holds (the master picks where to restore from)."""
        self.addr, self.port, self.last_step = addr, port, last_step
        self.memory = list(memory or [])

    def _join(self, node: NodeInfo, wait: float) -> JoinReply:
        body = JoinRequest(
            node_id=node.node_id,
            addr=self.addr,
            port=self.port,
            last_step=self.last_step,
            memory=self.memory,
        )
        request = urllib.request.Request(
            f"{self._url}{API_PREFIX}/rendezvous/join",
            data=body.model_dump_json().encode(),
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=wait + 10) as response:
                return JoinReply.model_validate_json(response.read())
        except urllib.error.HTTPError as exc:
            detail = json.loads(exc.read() or b"{}").get("error", "")
            raise RendezvousError(f"master refused to let {node.node_id} join: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise RendezvousError(f"master at {self._url} unreachable: {exc}") from exc

    def next_rendezvous(self, node: NodeInfo, timeout: float) -> RendezvousInfo:
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                raise RendezvousClosedError("the rendezvous is closed")
            reply = self._join(node, wait=min(5.0, max(0.1, deadline - time.monotonic())))
            if reply.state == "exit":
                self._closed = True
                raise RendezvousClosedError(reply.reason or "the job is over")
            if reply.state == "ready" and reply.info is not None:
                self.restart_count = reply.restart_count
                self.restore, self.persist_step = reply.restore, reply.persist_step
                return reply.info
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"{node.node_id} waited {timeout:g}s for a round to close: {reply.reason}"
                )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def shutdown(self) -> None:
        self._closed = True


@hookimpl
def planaria_rendezvous_backends() -> Iterable[RendezvousBackendRecord]:
    yield RendezvousBackendRecord(
        name="master",
        factory=MasterRendezvous,
        options=MasterRendezvousOptions,
        summary="the job master forms rounds; ranks survive node loss",
    )
