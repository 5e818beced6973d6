"""The job's summary and its faults as records: each fault with its recovery, the worker
failure a failed job ended on, and the figures ``planaria run`` prints at the end.

The summary is also kept in the run directory (``summary.json``, :func:`write_summary`), so
that ``planaria report`` shows the very figures ``planaria run`` printed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from planaria.diagnosis.preflight import PreflightReport
from planaria.diagnosis.stragglers import Straggler
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
    """``memory (step N)`` or ``storage``: where the restarted workers were told to restore;
    once they stepped, ``storage (step N)`` (or ``storage (no step)``), N the step before their
    first."""
    fault_class: str | None = None
    """``node``, ``transient`` or ``user`` (:mod:`planaria.diagnosis.classify`)."""
    reason: str = ""
    """What the diagnosis matched (a log pattern, a signal, a failed check)."""
    crashes: tuple[Crash, ...] = ()
    """The failed workers, when their node had completed no step in the round: what a crash
    loop is told by (:func:`planaria.master.policy.remember`)."""
    lower_bound: bool = False
    """The node trained on while no master heard it (it was lost before it re-attached to a
    resumed master): ``last_step`` is the last one known, so the steps lost are at least
    :attr:`steps_lost`."""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.time)

    @property
    def steps_lost(self) -> int | None:
        if self.first_step_after is None or self.last_step < 0:
            return None
        return max(0, self.last_step - self.first_step_after + 1)


TAIL_LINES = 15
TAIL_BYTES = 4096


def tail_of(text: str, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of ``text``, within ``max_bytes``: a traceback's end, which
    names the exception, fits; a long log does not flood the summary."""
    kept = text.rstrip("\n").splitlines()[-lines:]
    while kept and len("\n".join(kept).encode()) > max_bytes:
        kept.pop(0)
    if not kept and text:  # one line longer than the bound: its end
        kept = [text.rstrip("\n").encode()[-max_bytes:].decode("utf-8", "ignore")]
    return "\n".join(kept)


@dataclass
class FailedRank:
    """The worker failure that drove the job's last fault: where to read why."""

    rank: int
    node: str
    description: str
    log: str
    """The log that holds its output ("" when its agent did not say)."""
    tail: str
    """The last lines of its output (:func:`tail_of`): mostly its traceback's end."""


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
    not_written: list[str] = field(default_factory=list)
    """Files of the run's record that could not be written (a full disk), and why."""
    failed_rank: FailedRank | None = None
    """A job that did not succeed: the last worker failure that drove a fault, if any."""
    """The pre-flight node check, when the job ran one."""
    tokens: float | None = None
    """The tokens the job processed, as rank 0 reported them (``planaria.monitor.step(n,
    tokens=...)``); None when the training reported none."""

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

    @property
    def training_s(self) -> float:
        """The time spent training: wall time less start-up and recovery (goodput's part)."""
        return max(0.0, self.wall_s - (self.startup_s or 0.0) - self.downtime_s)

    @property
    def tokens_per_s(self) -> float | None:
        """The mean tokens per second over :attr:`training_s`: what a training run is compared
        by, its outages left out (the goodput tells those). None without tokens or time."""
        if self.tokens is None or self.training_s <= 0:
            return None
        return self.tokens / self.training_s


SUMMARY_FILE = "summary.json"


def write_summary(run_dir: Path, summary: Summary) -> Path:
    """``summary.json`` in ``run_dir`` (0600, like the rest of the run's record)."""
    path = run_dir / SUMMARY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(TypeAdapter(Summary).dump_json(summary, indent=1))
    return path


def read_summary(run_dir: Path) -> Summary | None:
    """The summary a run wrote; None when it wrote none (its master did not see it end).
    Raises :class:`ValueError` naming the file when it is not one."""
    path = run_dir / SUMMARY_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return TypeAdapter(Summary).validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(map(str, first["loc"])) or "<top>"
        raise ValueError(f"{path} is not a job summary ({where}: {first['msg']})") from None
