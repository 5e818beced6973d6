"""Job events: what observers (alerting, policy plugins) see through ``planaria_job_event``."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EventKind(str, Enum):
    JOB_STARTED = "job_started"
    JOB_FINISHED = "job_finished"
    HEALTH_CHECKED = "health_checked"
    PREFLIGHT_ROUND = "preflight_round"
    PREFLIGHT_COMPLETED = "preflight_completed"
    FAULT_DETECTED = "fault_detected"
    WORKERS_RESTARTED = "workers_restarted"
    NODE_REPLACED = "node_replaced"
    NODE_EXCLUDED = "node_excluded"
    RENDEZVOUS_COMPLETED = "rendezvous_completed"
    STRAGGLER_DETECTED = "straggler_detected"
    HANG_DETECTED = "hang_detected"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    """A restore found a committed step that does not verify, and used an older one."""
    STARTED_FROM_SCRATCH = "started_from_scratch"
    """Committed steps exist, none verifies: training started from step 0."""
    PERSISTER_RESTARTED = "persister_restarted"
    """A node's checkpoint persister died; its agent started a new one."""
    JOB_STOPPED = "job_stopped"
    MASTER_STALLED = "master_stalled"
    REGISTRATION_REFUSED = "registration_refused"


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
    data: dict[str, Any] = Field(default_factory=dict)
