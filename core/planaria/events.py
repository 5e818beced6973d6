"""Job events: what observers (alerting, policy plugins) see through ``planaria_job_event``.

Every kind has one payload model: :attr:`JobEvent.data` is checked against it when the event is
made (a field the kind does not have, or a missing one, is an error) and :attr:`JobEvent.payload`
gives it back typed. In the timeline (``events.jsonl``) an event is one JSON line, its payload
an object under ``data``; fields without a value are left out. ``docs/events.md`` lists the
kinds and their fields (:func:`table` writes it).

Why one module: the whole contract, every kind's model, reads in one place;
each is small, and :func:`table` writes the documentation from them all.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from planaria.diagnosis.messages import CheckFailure, HungRank
from planaria.fault_pattern.api import FaultClass


class EventKind(str, Enum):
    JOB_STARTED = "job_started"
    JOB_FINISHED = "job_finished"
    JOB_STOPPED = "job_stopped"
    REGISTRATION_REFUSED = "registration_refused"
    HEALTH_CHECKED = "health_checked"
    PREFLIGHT_ROUND = "preflight_round"
    PREFLIGHT_COMPLETED = "preflight_completed"
    FAULT_DETECTED = "fault_detected"
    HANG_DETECTED = "hang_detected"
    STRAGGLER_DETECTED = "straggler_detected"
    WORKERS_RESTARTED = "workers_restarted"
    RECOVERED = "recovered"
    NODE_EXCLUDED = "node_excluded"
    NODE_REPLACED = "node_replaced"
    NODE_REPLACEMENT_FAILED = "node_replacement_failed"
    NODE_REMOVED = "node_removed"
    RENDEZVOUS_COMPLETED = "rendezvous_completed"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    STARTED_FROM_SCRATCH = "started_from_scratch"
    PERSISTER_RESTARTED = "persister_restarted"
    MASTER_STALLED = "master_stalled"
    MASTER_ISOLATED = "master_isolated"
    MASTER_RESUMED = "master_resumed"
    NODE_REATTACHED = "node_reattached"
    NODE_FENCED = "node_fenced"
    PROGRESS = "progress"


class StopCause(str, Enum):
    """Why a job stopped (``job_stopped``), for an observer to tell without reading text."""

    RESTART_BUDGET_SPENT = "restart_budget_spent"
    USER_ERROR = "user_error"
    """``diagnosis.on_user_error: stop``."""
    CANNOT_START = "cannot_start"
    """The workers cannot start: the program, its environment or the node's size is wrong."""
    CRASH_LOOP = "crash_loop"
    """A rank failed the same way before any step in ``diagnosis.crash_loop_rounds`` rounds."""
    TOO_FEW_NODES = "too_few_nodes"
    """Fewer nodes than ``job.nodes`` needs are left, and no replacement comes."""
    JOIN_TIMEOUT = "join_timeout"
    """Too few nodes came within ``rendezvous.join_timeout`` (to a round, or to the pre-flight)."""
    PREFLIGHT = "preflight"
    """``planaria check --preflight`` found a faulty or slow node."""
    CHECKPOINT = "checkpoint"
    """Nothing to restore with ``require_restore``, or the last checkpoint was not persisted."""
    INTERRUPTED = "interrupted"
    """A signal (SIGINT, SIGTERM) or an operator stopped it."""


class Payload(BaseModel):
    """Base of the payload models; ``KIND`` is the event kind each belongs to."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    KIND: ClassVar[EventKind]


# -- the job ------------------------------------------------------------------------------


class JobStarted(Payload):
    """The nodes were asked of the scheduler."""

    KIND = EventKind.JOB_STARTED
    run_id: str
    nodes: list[str]


class JobFinished(Payload):
    """The training command succeeded on every node (and its last checkpoint is persisted)."""

    KIND = EventKind.JOB_FINISHED
    state: Literal["succeeded"] = "succeeded"


class JobStopped(Payload):
    """The job ended without success; the event's message says why in words."""

    KIND = EventKind.JOB_STOPPED
    state: Literal["failed"] = "failed"
    cause: StopCause


class RegistrationRefused(Payload):
    """An agent asked to register a node the job does not accept (never launched, gone, or
    registered by another agent)."""

    KIND = EventKind.REGISTRATION_REFUSED
    host: str
    pid: int
    why: str


class MasterStalled(Payload):
    """The master itself stalled; every node's heartbeat window was renewed."""

    KIND = EventKind.MASTER_STALLED
    seconds: float


class MasterIsolated(Payload):
    """No node was heard lately and some are silent past the heartbeat timeout: the master
    may be the one cut off, so it waits for ``master.grace`` before calling them lost."""

    KIND = EventKind.MASTER_ISOLATED
    nodes: int
    grace: float


class MasterResumed(Payload):
    """A master restarted on the run directory took the job over from its journal."""

    KIND = EventKind.MASTER_RESUMED
    round: int
    nodes: list[str]
    """The nodes it expects to re-attach."""
    down_s: float | None
    """From the last journal write of the master before to this one's start."""


class NodeReattached(Payload):
    """A node's agent re-attached to a restarted master with the round it runs."""

    KIND = EventKind.NODE_REATTACHED
    round: int | None
    restarted: bool
    """Its workers must restart: the job went on to a newer round meanwhile."""


class NodeFenced(Payload):
    """A node the master had declared lost reached it again and was told to stop."""

    KIND = EventKind.NODE_FENCED
    request: str


# -- diagnosis ----------------------------------------------------------------------------


class HealthChecked(Payload):
    """A node failed its health checks before a round."""

    KIND = EventKind.HEALTH_CHECKED
    healthy: bool
    host: str
    failures: list[CheckFailure]


class FaultDetected(Payload):
    """A fault: failed workers (``worker_failed``), a lost node (``node_lost``), a failed
    pre-flight check (``preflight``), or a fault injected on purpose (``chaos``). What is done
    about it follows as its own events (``workers_restarted``, ``node_replaced`` ...)."""

    KIND = EventKind.FAULT_DETECTED
    fault: Literal["worker_failed", "node_lost", "preflight", "chaos"]
    fault_class: FaultClass | None = None
    reason: str | None = None
    """What the diagnosis matched (a pattern's reason, a signal, a pre-flight verdict)."""
    matched: str | None = None
    """The log line that matched."""
    classified_by: str | None = None
    secondary: bool = False
    """Another failure of a round whose first failure drives the action."""
    round: int | None = None
    exitcode: int | None = None
    signal: int | None = None
    log_tail: str | None = None
    host: str | None = None
    first: str | None = None
    """``preflight``: why the node was a suspect in round 1."""
    rule: dict[str, Any] | None = None
    """``chaos``: the rule that fired."""


class HangDetected(Payload):
    """No step progress (or no first step) for ``timeout`` seconds; the ranks' stacks."""

    KIND = EventKind.HANG_DETECTED
    fault: Literal["hang"] = "hang"
    fault_class: Literal["transient"] = "transient"
    secondary: bool
    round: int
    timeout: float
    first_step: bool = False
    ranks: list[HungRank]


class StragglerDetected(Payload):
    """A rank (or, in the pre-flight check, a node) slower than ``factor`` x the others."""

    KIND = EventKind.STRAGGLER_DETECTED
    metric: str
    seconds: float
    others_s: float
    ratio: float
    factor: float
    action: str
    preflight: bool = False
    first: str | None = None
    host: str | None = None


class PreflightVerdict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    node: str
    verdict: Literal["faulty", "straggler", "cleared"]
    detail: str
    first: str
    metric: str | None = None
    seconds: float | None = None
    ratio: float | None = None
    host: str | None = None
    action: str | None = None


class PreflightGroup(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    group: str
    members: list[str]
    results: dict[str, dict[str, Any]]


class PreflightRound(Payload):
    """One round of the pre-flight node check: its groups' results, suspects or verdicts."""

    KIND = EventKind.PREFLIGHT_ROUND
    stage: str
    groups: list[PreflightGroup]
    baseline: dict[str, float]
    suspects: dict[str, str] = Field(default_factory=dict)
    verdicts: list[PreflightVerdict] = Field(default_factory=list)
    results: str


class PreflightCompleted(Payload):
    """The pre-flight check is over: every node checked, every verdict and its action."""

    KIND = EventKind.PREFLIGHT_COMPLETED
    nodes: list[str]
    rounds: int
    baseline: dict[str, float]
    verdicts: list[PreflightVerdict]


# -- recovery -----------------------------------------------------------------------------


class WorkersRestarted(Payload):
    """Every node was told to restart its workers in a new round: after a fault (one of
    ``max_restarts`` spent), or to let nodes standing by join (``scale_up``)."""

    KIND = EventKind.WORKERS_RESTARTED
    round: int
    cause: Literal["fault", "scale_up"]
    fault: str | None = None
    restart: int | None = None
    """The restarts spent, this one included (``fault``)."""
    max_restarts: int | None = None
    standby: list[str] | None = None
    """``scale_up``: the nodes that join."""


class Recovered(Payload):
    """Training runs again after a fault: the restarted round completed its first step."""

    KIND = EventKind.RECOVERED
    fault: str
    round: int
    recovery_s: float
    """From the fault to the first step after it."""
    steps_lost: int | None = None
    """Steps done before the fault that were done again."""


class NodeExcluded(Payload):
    """No node of the job runs on ``host`` again (diagnosed bad hardware)."""

    KIND = EventKind.NODE_EXCLUDED
    host: str


class NodeReplaced(Payload):
    """The scheduler gave a new node in place of the event's ``node``."""

    KIND = EventKind.NODE_REPLACED
    host: str
    replacement: str
    replacement_host: str
    excluded_host: str | None = None


class NodeReplacementFailed(Payload):
    """The scheduler could not give a node in place of the event's ``node``; ``action`` is
    what the job does without it (go on with fewer nodes, or stop)."""

    KIND = EventKind.NODE_REPLACEMENT_FAILED
    host: str
    error: str
    nodes_left: int
    action: str


class NodeRemoved(Payload):
    """A node was stopped and none asked for in its place; the job goes on with fewer."""

    KIND = EventKind.NODE_REMOVED
    host: str
    reason: str


class RendezvousCompleted(Payload):
    """A round closed: its members' node ranks, where their workers restore from, which
    members stood by until it (``job.standby``), and their topology labels."""

    KIND = EventKind.RENDEZVOUS_COMPLETED
    round: int
    ranks: dict[str, int]
    world_size: int
    restore: str
    """``memory:<step>`` or ``storage``."""
    restore_why: str
    persist_step: int | None = None
    from_standby: list[str] | None = None
    """Members that stood by, warm, until this round (``job.standby``): a lost node's place
    taken without a scheduler round trip."""
    topology: dict[str, dict[str, str]] | None = None
    """Each member's topology labels (``{"node-0": {"switch": "s1"}}``), when its scheduler
    gave any: what a topology rank placement grouped them by."""
    store: str | None = None
    """``host:port`` of the round's store when the master's host serves it
    (``rendezvous.store: master``); absent: the worker of rank 0 hosts it."""


# -- checkpoints --------------------------------------------------------------------------


class CheckpointCommitted(Payload):
    """A step's checkpoint is in storage, complete and verified (event ``step``)."""

    KIND = EventKind.CHECKPOINT_COMMITTED
    bytes: int | None = None
    seconds: float | None = None


class CheckpointFailed(Payload):
    """Persisting a step failed on a node (event ``step``, ``rank``)."""

    KIND = EventKind.CHECKPOINT_FAILED
    error: str


class CheckpointSkipped(Payload):
    """A restore found a committed step that does not verify, and used an older one."""

    KIND = EventKind.CHECKPOINT_SKIPPED
    error: str


class StartedFromScratch(Payload):
    """Committed steps exist, none verifies: training started from step 0 (or, with
    ``require_restore``, the job stops)."""

    KIND = EventKind.STARTED_FROM_SCRATCH
    error: str
    steps: list[int]
    required: bool


class PersisterRestarted(Payload):
    """A node's checkpoint persister died; its agent started a new one."""

    KIND = EventKind.PERSISTER_RESTARTED
    error: str


# -- progress -----------------------------------------------------------------------------


class Progress(Payload):
    """A node's step (event ``step``), sampled from its heartbeats: at its first step in a
    round, at its end, and every 5 s between (less often beyond 64 nodes). What ``planaria
    report`` plots the job's course by.

    The node of rank 0 is also sampled at each heartbeat that brings a new training loss of
    rank 0 (``planaria.monitor.step(n, loss=...)``): ``loss`` and the step it was reported
    with, ``loss_step``. One series for the job, bounded by the heartbeat interval whatever
    the number of nodes and steps.

    When the training reports the tokens of its steps (``planaria.monitor.step(n,
    tokens=...)``), each sample of rank 0's node has the job's ``tokens`` so far (every round's,
    what ``planaria_tokens_total`` counts) and ``round_tokens``, those of this round's workers:
    what ``planaria report`` draws tokens/s from, and what a resumed master counts on from."""

    KIND = EventKind.PROGRESS
    round: int
    loss: float | None = None
    loss_step: int | None = None
    tokens: float | None = None
    round_tokens: float | None = None


PAYLOADS: dict[EventKind, type[Payload]] = {m.KIND: m for m in Payload.__subclasses__()}
assert set(PAYLOADS) == set(EventKind), "every event kind has one payload model"


class JobEvent(BaseModel):
    """One thing that happened to a job. Serialised as one JSON line in the event timeline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: EventKind
    job: str
    time: float = Field(default_factory=time.time)
    node: str | None = None
    rank: int | None = None
    step: int | None = None
    message: str = ""
    data: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """The kind's payload (:attr:`payload`), as JSON."""

    @field_validator("data", mode="before")
    @classmethod
    def _of_its_kind(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        if kind is None:
            return value  # the kind itself is wrong: that is the error to report
        model = PAYLOADS[kind]
        try:
            payload = value if isinstance(value, model) else model.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '<data>'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise ValueError(f"not a {model.__name__} payload ({problems})") from None
        return payload.model_dump(mode="json", exclude_none=True)

    @classmethod
    def of(
        cls,
        payload: Payload,
        *,
        job: str,
        message: str = "",
        node: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> JobEvent:
        return cls(
            kind=payload.KIND,
            job=job,
            message=message,
            node=node,
            rank=rank,
            step=step,
            data=payload.model_dump(mode="json", exclude_none=True),
        )

    @property
    def payload(self) -> Payload:
        """``data`` as its kind's model (:class:`NodeReplaced` for ``node_replaced`` ...)."""
        return PAYLOADS[self.kind].model_validate(self.data)

    @classmethod
    def from_line(cls, line: str) -> JobEvent:
        """An event from a line of a timeline. A line written before payloads were typed
        is read too: with its kind as it is called now (``workers_restarted`` saying
        "recovered from ..." is ``recovered``; a ``node_replaced`` with ``ok: false`` is
        ``node_replacement_failed`` or ``node_removed``) and its ``data`` as it was,
        unchecked, so that its :attr:`payload` may not validate."""
        raw = json.loads(line)
        try:
            return cls.model_validate(raw)
        except ValidationError:
            kind = _old_kind(raw)
            if kind is None:
                raise
            return cls.model_construct(**{**raw, "kind": kind})


def _old_kind(raw: object) -> EventKind | None:
    """The kind of an event line of an older planaria; None if it is not one."""
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        return None
    if not isinstance(raw.get("job"), str) or not isinstance(raw.get("time"), (int, float)):
        return None
    try:
        kind = EventKind(raw.get("kind"))
    except ValueError:
        return None
    data, message = raw["data"], str(raw.get("message", ""))
    if kind is EventKind.WORKERS_RESTARTED and "recovery_s" in data:
        return EventKind.RECOVERED
    if kind is EventKind.NODE_REPLACED and data.get("ok") is False:
        failed = message.startswith("replacing ")
        return EventKind.NODE_REPLACEMENT_FAILED if failed else EventKind.NODE_REMOVED
    return kind


def table() -> str:
    """The kinds and their payload fields as a Markdown table (``docs/events.md``)."""
    rows = ["| kind | fields (`?`: may be absent) | when |", "| --- | --- | --- |"]
    for kind, model in PAYLOADS.items():
        fields = ", ".join(
            f"`{name}{'?' if field.default is None and not field.is_required() else ''}`"
            for name, field in model.model_fields.items()
        )
        when = " ".join((model.__doc__ or "").split()).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{kind.value}` | {fields} | {when} |")
    return "\n".join(rows)
