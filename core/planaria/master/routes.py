"""The master's API as one table: each route's method, path, request and reply models, summary
and the call that serves it.

The server registers its handlers from this table and :mod:`planaria.master.openapi` writes
the API's document from it, so the two cannot drift apart: a new route is one row.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from planaria.diagnosis.messages import (
    HangReport,
    HealthReport,
    PreflightOrder,
    PreflightPoll,
    PreflightResult,
)
from planaria.master.job import Master, beat_reply
from planaria.master.metrics import MEDIA_TYPE, Exposition, JobMetrics
from planaria.master.state import Deferred
from planaria.protocol import (
    API_PREFIX,
    Ack,
    ActionRequest,
    BindReply,
    BindRequest,
    ChaosReport,
    CheckpointEvent,
    Heartbeat,
    HeartbeatReply,
    JobStatus,
    JoinReply,
    JoinRequest,
    Probe,
    ReattachReply,
    ReattachRequest,
    RegisterReply,
    RegisterRequest,
    WorkersOutput,
    WorkersReport,
)


@dataclass(frozen=True)
class Context:
    """What a route's call gets besides its request body."""

    master: Master
    hold: float
    """The longest a long poll (a heartbeat that waits, a pre-flight poll) holds a request."""
    join_hold: float
    """The longest a rendezvous join waits for its round to close before answering ``wait``."""
    metrics: JobMetrics
    binding: Callable[[str], str] | None = None
    """The proof of the job's token over ``nonce`` and the served certificate
    (:mod:`planaria.master.binding`); None when the API is not served over TLS."""


JSON = "application/json"

Call = Callable[[Context, Any], "BaseModel | Deferred[BaseModel] | Awaitable[BaseModel]"]


@dataclass(frozen=True)
class Route:
    method: Literal["GET", "POST"]
    path: str
    request: type[BaseModel] | None
    """The JSON body's model; ``None``: the route takes no body."""
    reply: type[BaseModel]
    summary: str
    call: Call
    """``call(context, body)``: the reply, or an awaitable of it, or the reply :class:`Deferred`
    back (a long poll); ``body`` is the validated request model, ``None`` for a route without
    one."""
    errors: tuple[int, ...] = ()
    """Error statuses the call itself may answer, beyond those every route shares (401 without
    the token; 400, 408 and 413 for a body)."""
    public: bool = False
    """Served without the token: only for probes that reveal nothing about the job."""
    public_with: str | None = None
    """The config option that, set to true, serves the route without the token."""
    media_type: str = JSON
    """The reply's media type. Other than JSON, the reply model is a string's (a
    ``RootModel[str]``), served as it is."""
    channel: bool = False
    """Served on the agents' channel too (:mod:`planaria.master.channel`), where agents send
    it: a node's request, with a JSON body."""
    notice: bool = False
    """Also taken on the channel as a notice, which wants no reply (a heartbeat: the next one
    says it again). Its call answers at once."""
    idle: Callable[[Any], bool] | None = None
    """Whether a reply of the route tells of nothing decided (a heartbeat's "nothing due"):
    on the channel such a reply is sent at once, not after the journal's next write, since the
    agent acts on nothing in it (what the request changed is written as a notice's is)."""

    @property
    def operation_id(self) -> str:
        name = self.path.removeprefix(API_PREFIX).strip("/").replace("/", "_").replace("-", "_")
        return f"{self.method.lower()}_{name}"


def _heartbeat(c: Context, beat: Heartbeat) -> HeartbeatReply | Deferred[HeartbeatReply]:
    action = c.master.heartbeat(beat, c.hold if beat.wait else 0.0)
    if isinstance(action, Deferred):
        return action.map(beat_reply)
    return beat_reply(action)


def _nothing_due(reply: HeartbeatReply) -> bool:
    return reply.action.kind == "none"


def _bind(c: Context, body: BindRequest) -> BindReply:
    if c.binding is None:
        raise UnknownRoute("this master serves plain HTTP: there is no certificate to bind")
    return BindReply(proof=c.binding(body.nonce))


class UnknownRoute(LookupError):
    """A route this master does not serve as configured (404)."""


def acked(report: Callable[[Context, Any], None]) -> Call:
    """The call of a route that takes a report and answers :class:`Ack` once it is taken."""

    def call(context: Context, body: Any) -> Ack:
        report(context, body)
        return Ack()

    return call


UNKNOWN_NODE = 404
"""The node named in the body is not one the master knows: it must register first."""
REATTACH = 409
"""The master was restarted and this node has not re-attached to it yet: ``/v1/reattach``."""
FENCED = 410
"""The node was declared lost: it must stop its workers (another may train in its place)."""
REPORT = (UNKNOWN_NODE, REATTACH)
"""Errors of a node's report of what happened (taken even from a fenced node)."""
NODE = (*REPORT, FENCED)
"""Errors of every other request of a node."""

ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        f"{API_PREFIX}/register",
        RegisterRequest,
        RegisterReply,
        "An agent registers its node (launched by the scheduler) and gets the job's spec",
        lambda c, body: RegisterReply(spec=c.master.register(body)),
        errors=(403, 503),
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/reattach",
        ReattachRequest,
        ReattachReply,
        "An agent tells a restarted master what its node runs, to go on with it",
        lambda c, body: c.master.reattach(body),
        errors=(UNKNOWN_NODE, 403, FENCED),
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/rendezvous/join",
        JoinRequest,
        JoinReply,
        "Join the next round: ready with ranks once it closes, wait (ask again), or exit",
        lambda c, body: c.master.join(body, c.join_hold),
        errors=NODE,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/heartbeat",
        Heartbeat,
        HeartbeatReply,
        "A node's progress; with wait (agents before the channel), held until an action is "
        "due (a long poll)",
        _heartbeat,
        errors=NODE,
        channel=True,
        notice=True,
        idle=_nothing_due,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/workers",
        WorkersReport,
        Ack,
        "A node's workers all succeeded, or the first of them failed",
        acked(lambda c, report: c.master.workers_report(report)),
        errors=REPORT,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/output",
        WorkersOutput,
        Ack,
        "Lines a node's workers wrote, for the planaria run console",
        acked(lambda c, report: c.master.worker_output(report)),
        errors=REPORT,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/chaos",
        ChaosReport,
        Ack,
        "A fault injected on purpose is about to fire on a node",
        acked(lambda c, report: c.master.diagnosis.chaos(report)),
        errors=NODE,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/checkpoint/event",
        CheckpointEvent,
        Ack,
        "What a node's persister did, or what a worker's restore found",
        acked(lambda c, event: c.master.checkpoint_event(event)),
        errors=REPORT,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/hang",
        HangReport,
        Ack,
        "Ranks of a node made no step progress within the hang timeout",
        acked(lambda c, report: c.master.diagnosis.hang(report)),
        errors=NODE,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/health",
        HealthReport,
        Ack,
        "A node failed its health checks before a round: it asks to be replaced",
        acked(lambda c, report: c.master.diagnosis.unhealthy(report)),
        errors=NODE,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/preflight/next",
        PreflightPoll,
        PreflightOrder,
        "What a node does next in the pre-flight node check (a long poll)",
        lambda c, poll: c.master.preflight.next(poll, c.hold),
        errors=NODE,
        channel=True,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/preflight/result",
        PreflightResult,
        Ack,
        "A node's result of one pre-flight benchmark run",
        acked(lambda c, result: c.master.preflight.result(result)),
        errors=NODE,
        channel=True,
    ),
    Route(
        "GET",
        f"{API_PREFIX}/status",
        None,
        JobStatus,
        "The job's state, round, restarts, step and nodes",
        lambda c, _: c.master.status(),
    ),
    Route(
        "GET",
        "/metrics",
        None,
        Exposition,
        "The job's metrics in Prometheus' text format (docs/metrics.md); without the token "
        "only with master.metrics_public: true",
        lambda c, _: c.metrics.exposition(),
        public_with="master.metrics_public",
        media_type=MEDIA_TYPE,
    ),
    Route(
        "POST",
        f"{API_PREFIX}/bind",
        BindRequest,
        BindReply,
        "An agent that holds the job's token learns the master's certificate: the master "
        "proves the token over the agent's nonce and the certificate the connection shows "
        "(an HMAC), before the agent sends anything of the job's; no token needed",
        _bind,
        errors=(404,),
        public=True,
    ),
    Route(
        "GET",
        "/healthz",
        None,
        Probe,
        "Liveness probe (Kubernetes): answers while the master serves; no token needed",
        lambda c, _: Probe(),
        public=True,
    ),
)

CHANNEL_ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        f"{API_PREFIX}/actions",
        ActionRequest,
        HeartbeatReply,
        "The node's next action (start a round, restart, exit), answered the moment the master "
        "decides it; 410 once the node is fenced. Only on the channel: it has no time limit",
        lambda c, body: c.master.next_action_for(body),
        errors=NODE,
        channel=True,
    ),
)
"""The channel's own requests (:mod:`planaria.master.channel`), not served over plain HTTP."""
