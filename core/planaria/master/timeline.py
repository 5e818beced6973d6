"""The job's record: every event as one JSON line, each fault with its recovery, the summary."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from planaria.diagnosis.preflight import PreflightReport
from planaria.diagnosis.stragglers import Straggler
from planaria.events import JobEvent, Payload
from planaria.master.policy import Crash


@dataclass
class Fault:
    """One fault and what became of it. ``recovery_s`` runs from the fault to the first step
    the restarted job completed."""

    kind: str
    node: str
    detail: str
    time: float
    action: str
    rank: int | None = None
    last_step: int = -1
    restart_round: int | None = None
    recovered_at: float | None = None
    first_step_after: int | None = None
    restored_from: str | None = None
    """``memory (step N)`` or ``storage``: where the restarted workers were told to restore."""
    fault_class: str | None = None
    """``node``, ``transient`` or ``user`` (:mod:`planaria.diagnosis.classify`)."""
    reason: str = ""
    """What the diagnosis matched (a log pattern, a signal, a failed check)."""
    crashes: tuple[Crash, ...] = ()
    """The failed workers, when their node had completed no step in the round: what a crash
    loop is told by (:func:`planaria.master.policy.remember`)."""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.time)

    @property
    def steps_lost(self) -> int | None:
        if self.first_step_after is None or self.last_step < 0:
            return None
        return max(0, self.last_step - self.first_step_after + 1)


NO_STEPS = (
    "the training command never reported a step: call planaria.monitor.step(n) or Checkpointer.save"
)


@dataclass
class Summary:
    state: str
    reason: str
    steps: int
    wall_s: float
    startup_s: float | None
    downtime_s: float
    restarts: int
    faults: list[Fault] = field(default_factory=list)
    checkpoints: int = 0
    """Flash checkpoints committed to storage."""
    last_checkpoint: int | None = None
    unpersisted: str = ""
    """Set when the last step asked to persist was not: "last persisted step N of M (...)"."""
    skipped_checkpoints: list[str] = field(default_factory=list)
    """Committed steps a restore skipped as corrupt, each with why."""
    started_from_scratch: str = ""
    """Why training started from scratch although committed steps exist."""
    persister_restarts: int = 0
    stragglers: list[Straggler] = field(default_factory=list)
    preflight: PreflightReport | None = None
    """The pre-flight node check, when the job ran one."""

    @property
    def stepped(self) -> bool:
        """Whether the training command reported any step: without one, neither the steps
        done nor the goodput are known (0 and 100% would be guesses)."""
        return self.steps > 0 or self.startup_s is not None

    @property
    def goodput(self) -> float | None:
        """Productive time over wall time: what was not start-up nor recovery. None when no
        step was reported: start-up then never ended, as far as the master can tell."""
        if not self.stepped:
            return None
        if self.wall_s <= 0:
            return 0.0
        lost = (self.startup_s or 0.0) + self.downtime_s
        return max(0.0, min(1.0, (self.wall_s - lost) / self.wall_s))


class Timeline:
    """Appends events to ``events.jsonl`` (0600) and hands each to ``observer``, then to those
    that :meth:`watch` it."""

    def __init__(self, path: Path, job: str, observer: Callable[[JobEvent], None]) -> None:
        self.path = path
        self.job = job
        self.observers = [observer]
        self.events: list[JobEvent] = []
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    def emit(
        self,
        payload: Payload,
        message: str,
        *,
        node: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> JobEvent:
        """Record an event of ``payload``'s kind; ``message`` says it in words."""
        event = JobEvent.of(payload, job=self.job, message=message, node=node, rank=rank, step=step)
        self.events.append(event)
        self._file.write(event.model_dump_json() + "\n")
        for observer in self.observers:
            observer(event)
        return event

    def watch(self, observer: Callable[[JobEvent], None]) -> None:
        """Hand every later event to ``observer`` too (the master's metrics)."""
        self.observers.append(observer)

    def close(self) -> None:
        self._file.close()
