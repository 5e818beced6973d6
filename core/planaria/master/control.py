"""What the parts that observe a job (diagnosis, the pre-flight check) may see of it and ask of it.

They find faults; the master decides (:mod:`planaria.master.policy`) and acts. They see the job
through this narrow interface, never through the master's own attributes, so that the master
can change its insides without them, and they can be tested against a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from planaria.events import JobEvent, Payload, StopCause
from planaria.master.policy import Decision, FaultType, Source
from planaria.master.state import JobSettings, Node
from planaria.master.summary import Fault
from planaria.protocol import RendezvousInfo


class JobControl(Protocol):
    @property
    def settings(self) -> JobSettings: ...

    @property
    def nodes(self) -> Mapping[str, Node]:
        """Every node the job has had, gone ones included."""
        ...

    @property
    def round(self) -> int:
        """The rendezvous round forming, or running."""
        ...

    @property
    def world(self) -> Mapping[str, RendezvousInfo]:
        """The running round's members (empty while a round forms)."""
        ...

    @property
    def training(self) -> bool:
        """A round is running."""
        ...

    @property
    def stopping(self) -> bool:
        """The job is over, or ending."""
        ...

    @property
    def stop_reason(self) -> str: ...

    def heard_from(self, node_id: str, *, fence: bool = True) -> Node:
        """The node that just spoke (its heartbeat window starts again); UnknownNode if unknown.
        One declared lost is told to stop (``fence``:
        :class:`~planaria.master.state.FencedRequest`)."""
        ...

    def replacing(self) -> bool:
        """A replacement asked of the scheduler has not come back yet."""
        ...

    def emit(
        self,
        payload: Payload,
        message: str,
        *,
        node: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> JobEvent:
        """Put an event in the job's timeline (and before its observers)."""
        ...

    def saw_step(self, step: int) -> None:
        """Some report told of ``step``: training got at least that far."""
        ...

    def report_fault(
        self,
        fault: Fault,
        type_: FaultType,
        source: Source,
        *,
        before: Callable[[Decision], None] | None = None,
    ) -> Decision:
        """Have the job decide on ``fault`` (of node ``fault.node``) and carry the decision
        out; ``before`` hears it first (to say it in the finding's own event, which then comes
        before the events of what is done). ``fault.action`` says what was decided."""
        ...

    def stop(self, reason: str, cause: StopCause = StopCause.INTERRUPTED) -> None:
        """End the job, failed, with ``reason``."""
        ...

    def preflight_finished(self, *, passed: bool, message: str) -> None:
        """The pre-flight check is over: the first round may open (or, when the check was
        all the job had to do, the job ends with its verdict)."""
        ...
