"""The wire format between agents and the master: JSON of these models under ``/v1``.

Versioned by path: a change that old agents cannot read gets a new prefix. Never pickle.
Every request carries the job's token (``Authorization: Bearer ...``).

Why one module: these models are one contract between two programs of different versions (an
agent and a master); kept together, a change to the wire is one reviewable diff, and each
model's compatibility (optional fields with defaults) is checked against its neighbours.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from planaria.chaos import ChaosRule
from planaria.diagnosis.messages import DiagnosisSpec

API_PREFIX = "/v1"
SPREAD_NODES = 256
"""From this many nodes in a round, each node's first heartbeat of the round comes at a random
time within the interval (an agent on the channel waits that long before it; an older agent's
long poll is held that long), not at once. Every node starts a round at the same moment: beating
alike, they would come as one wave each interval, all of it queued in front of the master (at
10,000 nodes a wave is most of a second of its time). Below this, a wave is a few
milliseconds."""
TOKEN_ENV = "PLANARIA_TOKEN"
MASTER_ENV = "PLANARIA_MASTER"
FINGERPRINT_ENV = "PLANARIA_MASTER_FINGERPRINT"
"""SHA-256 of the master's certificate (hex), which agents pin when its URL is ``https``."""
NODE_ID_ENV = "PLANARIA_NODE_ID"
HOST_ENV = "PLANARIA_HOST"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaSpec(Message):
    """The job's ``checkpoint.replica`` section: each node copies its newest saved step to the
    next node of the ring (its buddy), into the buddy's shared memory."""

    every: int = 1
    """Copy a saved step whose number is a multiple of this (the newest such, when a copy is
    still under way)."""
    max_mb_per_second: float | None = None
    """The most bytes a node sends its buddy per second, in millions (None: no bound)."""


class CheckpointSpec(Message):
    """The job's ``checkpoint`` section, as agents and workers need it."""

    storage: dict[str, Any]
    """``{"backend": ..., "options": {...}}``, options validated by the master."""
    keep_last: int = 3
    persist_every: int = 100
    persist_on_fault: bool = True
    require_restore: bool = False
    """Committed steps that all fail verification stop the job instead of a fresh start."""
    allow_unpersisted_end: bool = False
    """A job whose last persist failed may still end as succeeded (the master's rule)."""
    persister_timeout: float = 5.0
    """The most seconds a save waits for the persister; one that does not answer is replaced."""
    replica: ReplicaSpec | None = None
    """Peer replicas (``checkpoint.replica``): None when the job keeps none."""


class JobSpec(Message):
    """What every agent needs to run its part of the job; sent on registration."""

    job: str
    run_id: str
    run_dir: str
    command: list[str]
    workdir: str
    env: dict[str, str]
    procs_per_node: int
    max_restarts: int
    heartbeat_interval: float
    heartbeat_timeout: float
    master_grace: float = 60.0
    """How long an agent that lost the master keeps its workers training, trying to reach it
    again (a restarted master takes the job over), before it stops them."""
    stop_grace: float
    preload: list[str]
    log_max_bytes: int = 100 << 20
    """Each worker log is rotated past this size, ``log_keep`` rotated files kept."""
    log_keep: int = 3
    log_dir: str | None = None
    """Where the worker logs go (``rank-N.log``); None: the run's ``logs/``."""
    console: bool = True
    """Forward the workers' output to the master, which shows it on the console."""
    redirects: int | dict[int, int] = 0
    """Streams (1 stdout, 2 stderr, 3 both) kept off the console, for every local rank or
    per local rank (torchrun's ``--redirects``)."""
    tee: int | dict[int, int] = 0
    """Redirected streams shown on the console all the same (torchrun's ``--tee``)."""
    local_ranks_filter: list[int] | None = None
    """The local ranks whose output the console shows; None: all."""
    chaos: list[ChaosRule] = Field(default_factory=list)
    checkpoint: CheckpointSpec | None = None
    diagnosis: DiagnosisSpec = Field(default_factory=DiagnosisSpec)


class RegisterRequest(Message):
    node_id: str
    host: str
    addr: str
    pid: int


class RegisterReply(Message):
    spec: JobSpec


class MemoryHolding(Message):
    """The complete steps one local rank's shared memory holds, and as which rank they were
    saved."""

    local_rank: int
    rank: int
    world: int
    steps: list[int]


class ReplicaHolding(Message):
    """The complete steps of one rank that this node keeps as a peer's replica."""

    rank: int
    world: int
    steps: list[int]
    source: str = ""
    """The node whose memory the replica copies."""


class ReplicaEndpoint(Message):
    """Where a node's replica server listens."""

    node_id: str
    addr: str
    port: int = Field(ge=1, le=65535)


class ReplicaFetch(Message):
    """Copy ``rank``'s ``step`` from the replica ``holder`` keeps into this node's memory,
    as ``local_rank``'s, before the workers start (they then restore it from memory)."""

    local_rank: int
    rank: int
    world: int
    step: int
    holder: ReplicaEndpoint


class ReattachRequest(Message):
    """An agent meets a restarted master: who it is and what it runs, so that the master
    goes on with the same round instead of restarting its workers."""

    node_id: str
    host: str
    addr: str
    pid: int
    round: int | None = None
    """The round this node's workers run (None: it is not in a running round)."""
    node_rank: int | None = None
    last_step: int = -1
    memory: list[MemoryHolding] = Field(default_factory=list)


class ReattachReply(Message):
    """``continue``: carry on (an action, if one is due, comes with the next heartbeat)."""

    state: Literal["continue"]
    reason: str = ""


class RendezvousInfo(Message):
    """What a node gets when a round closes: enough to set torch.distributed's environment."""

    round: int
    node_rank: int
    num_nodes: int
    rank_offset: int
    """Global rank of this node's local rank 0."""
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool = False
    """Whether the store at ``master_addr:master_port`` serves already, hosted off the workers
    (``rendezvous.store: master``): every worker connects to it as a client. False: the
    worker of global rank 0 hosts it, on the node of rank 0's address."""

    @model_serializer(mode="wrap")
    def _compatible(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out while false: an agent from before the field (which forbids unknown keys)
        # still reads a round whose store is rank 0's.
        data = handler(self)
        if not self.agent_store and isinstance(data, dict):
            data.pop("agent_store", None)
        return data

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # The fields' schema: the serializer above only leaves one out, at its default.
        fields = cast(CoreSchema, {k: v for k, v in core_schema.items() if k != "serialization"})
        return handler(fields)


class JoinRequest(Message):
    node_id: str
    addr: str
    """The address other nodes reach this one at (torch.distributed's MASTER_ADDR if rank 0)."""
    port: int = Field(ge=1, le=65535)
    """A port free on this host, offered for MASTER_PORT in case this node gets rank 0."""
    last_step: int = -1
    """The highest step this node's workers completed before this join (-1: none)."""
    memory: list[MemoryHolding] = Field(default_factory=list)
    """Flash-checkpoint steps held in this node's shared memory."""
    replica_port: int | None = Field(default=None, ge=1, le=65535)
    """The port of this node's replica server (at ``addr``), when the job keeps replicas."""
    replicas: list[ReplicaHolding] = Field(default_factory=list)
    """Peers' steps this node keeps as replicas."""


class RoundDirectives(Message):
    """What the master tells a node's workers about the round they start: apart from the
    round's world, since they are the master's decisions, not the rendezvous's."""

    restart_count: int = 0
    """Restarts of the job so far (``TORCHELASTIC_RESTART_COUNT``)."""
    restore: str = "storage"
    """Where workers restore from this round: ``memory:<step>`` when every rank holds that
    step in memory, else ``storage``."""
    persist_step: int | None = None
    """Persist this step from memory before training resumes (``persist_on_fault``)."""
    replica_to: ReplicaEndpoint | None = None
    """The buddy this node copies its newest saved step to, this round (None: none)."""
    fetch: list[ReplicaFetch] = Field(default_factory=list)
    """Replicas to copy into this node's memory before its workers start."""


class JoinReply(Message):
    """``wait`` (ask again), ``exit`` (the job is over: ``reason``) or ``ready``: the round
    closed with this node in it (``info``) and the master's ``directives`` for it."""

    state: Literal["ready", "wait", "exit"]
    info: RendezvousInfo | None = None
    directives: RoundDirectives = Field(default_factory=RoundDirectives)
    reason: str = ""


class CheckpointEvent(Message):
    """What a node's persister did (``checkpoint_committed``, ``persist_failed``), what became
    of it (``persister_restarted``), or what a worker's restore found (``checkpoint_skipped``,
    ``started_from_scratch``)."""

    node_id: str
    event: str
    step: int = -1
    rank: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    error: str = ""
    steps: list[int] = Field(default_factory=list)
    """``started_from_scratch``: the committed steps that all failed verification."""


NodeActivity = Literal["idle", "running", "succeeded", "failed"]


class RankProgress(Message):
    local_rank: int
    step: int
    time: float
    step_s: float | None = None
    """Median wall-clock seconds per step over ``diagnosis.straggler_window`` steps."""
    busy_s: float | None = None
    """Median busy (CPU, or worker-given) seconds per step over the same window."""
    first_step: int = -1
    """The first step this rank's worker completed in this round (-1: none yet)."""
    loss: float | None = None
    """The last training loss the worker reported (``planaria.monitor.step(n, loss=...)``)."""
    loss_step: int = -1
    """The step reported with :attr:`loss` (-1: none)."""
    tokens: float | None = None
    """The tokens the worker reported (``planaria.monitor.step(n, tokens=...)``), summed over
    its steps in this round."""
    tokens_step: int = -1
    """The last step reported with tokens (-1: none)."""


class Heartbeat(Message):
    node_id: str
    round: int
    activity: NodeActivity
    progress: list[RankProgress] = Field(default_factory=list)
    first_step_time: float | None = None
    """When this node's first worker completed its first step in this round."""
    wait: bool = True
    """Hold the request until an action is due (a long poll over HTTP, as agents before the
    channel did), or answer at once (agents on the channel ask ``/actions`` for that)."""


class ActionRequest(Message):
    """The node's next action, asked on the channel: answered when the master decides it."""

    node_id: str
    round: int
    """The round the node runs (or last ran)."""


class Action(Message):
    kind: Literal["none", "restart", "exit"]
    round: int = 0
    reason: str = ""


class HeartbeatReply(Message):
    action: Action


class WorkerFailure(Message):
    local_rank: int
    rank: int
    pid: int
    exitcode: int | None
    signal: int | None
    time: float
    log_tail: str
    description: str
    start_error: str | None = None
    """Why the worker never started (the program is missing, the environment too large, the
    node too small): the fault is the job's own, and a restart would fail the same way."""
    log_path: str | None = None
    """The log that holds the worker's output (its traceback): what the summary names."""
    replica_error: ReplicaFetch | None = None
    """The replica fetch that failed before the workers started: the master does not plan
    from that replica again."""


class WorkersReport(Message):
    """Sent when a node's workers all succeeded, or at the first failure."""

    # The rule the master holds a report to, in its schema: a failure report names the failure.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"succeeded": {"const": False}}},
            "then": {"required": ["failure"], "properties": {"failure": {"type": "object"}}},
        }
    )

    node_id: str
    round: int
    succeeded: bool
    failure: WorkerFailure | None = None
    also: list[WorkerFailure] = Field(default_factory=list)
    """Other workers of the node that failed on their own (not stopped by the agent)."""
    last_step: int = -1
    """The highest step any local worker completed in this round."""
    progress: list[RankProgress] = Field(default_factory=list)
    """The workers' last progress (as a heartbeat brings it): the loss and the tokens they
    reported after the node's last heartbeat still count."""


Stream = Literal["stdout", "stderr", "output"]
"""Which of a worker's streams a line came from; ``output``: stdout and stderr share a pipe."""


class OutputLine(Message):
    """One line a worker wrote, without its line end."""

    rank: int
    text: str
    stream: Stream = "output"
    """``output``: the worker's stdout and stderr share one pipe (both go to the console)."""


class WorkersOutput(Message):
    """What a node's workers wrote, for the ``planaria run`` console; ``dropped`` lines were
    not forwarded because the console could not keep up."""

    node_id: str
    lines: list[OutputLine] = Field(default_factory=list, max_length=100_000)
    dropped: int = 0


class ChaosReport(Message):
    node_id: str
    rule: ChaosRule
    time: float
    step: int = -1
    """The highest step the node's workers completed when the rule fired (-1: none)."""


class Ack(Message):
    ok: bool = True


class Probe(Message):
    """``GET /healthz``: the master is serving."""

    ok: bool = True


class BindRequest(Message):
    """``POST /v1/bind``: an agent that knows the job's token but not yet the master's
    certificate asks the master to prove the token over the connection's certificate."""

    nonce: str = Field(pattern=r"^[0-9a-f]{32,128}$")


class BindReply(Message):
    proof: str
    """HMAC-SHA256 under the job's token of the nonce and the certificate's fingerprint
    (:func:`planaria.master.binding.proof`), lowercase hex."""


class ApiError(Message):
    """Every error the API answers: what is wrong and what to do."""

    error: str
    retry: bool = False
    """503 only: the master cannot answer yet (a launch in flight); ask again shortly."""


class InvalidRequest(ApiError):
    """400: a request body that does not validate, or that makes no sense for the job."""

    problems: list[str]
    """One line per invalid field, ``path.to.field: what is wrong`` (``<body>``: the body as a
    whole); empty when the body is valid but the job cannot accept it."""


class NodeStatus(Message):
    node_id: str
    host: str
    state: str
    node_rank: int | None
    step: int
    """The last step the node's workers completed, as the master last heard (-1: none)."""
    topology: dict[str, str] = Field(default_factory=dict)
    """Where its scheduler says it stands (``{"switch": "s1"}``): the labels a topology rank
    placement groups nodes by; empty when the scheduler does not know."""


class JobStatus(Message):
    job: str
    run_id: str
    state: str
    round: int
    restarts: int
    max_restarts: int
    step: int
    """The newest step the job's workers completed, as the master heard (-1: none): a step's
    number, not a count (see ``steps_done``)."""
    nodes: list[NodeStatus]
    steps_done: int = 0
    """Steps done in this run, counted as the summary counts them: from the first step
    reported to the last, both included."""
    reason: str = ""
