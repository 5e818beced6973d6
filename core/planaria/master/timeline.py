"""The job's record: every event as one JSON line, each fault with its recovery, the summary.

The summary is also kept in the run directory (``summary.json``, :func:`write_summary`), so
that ``planaria report`` shows the very figures ``planaria run`` printed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from planaria.diagnosis.preflight import PreflightReport
from planaria.diagnosis.stragglers import Straggler
from planaria.events import EventKind, JobEvent, Payload
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


@dataclass(frozen=True)
class Row:
    """A line of the summary as ``planaria run`` prints it (and ``planaria report`` shows it)."""

    what: str
    value: str
    alarm: bool = False


def summary_rows(summary: Summary) -> list[Row]:
    rows = [Row("result", f"{summary.state}: {summary.reason}")]
    rows.append(
        Row("steps done", str(summary.steps) if summary.stepped else f"unknown: {NO_STEPS}")
    )
    rows.append(Row("wall time", f"{summary.wall_s:.2f}s"))
    if summary.startup_s is not None:
        rows.append(Row("start-up (to first step)", f"{summary.startup_s:.2f}s"))
    rows.append(Row("restarts", str(summary.restarts)))
    rows.append(Row("downtime (recovery)", f"{summary.downtime_s:.2f}s"))
    rows.append(Row("goodput", _goodput(summary)))
    if summary.checkpoints:
        last = f"{summary.checkpoints} (last: step {summary.last_checkpoint})"
        rows.append(Row("checkpoints committed", last))
    if summary.unpersisted:
        rows.append(Row("not persisted", summary.unpersisted, alarm=True))
    if summary.persister_restarts:
        rows.append(Row("persister restarts", str(summary.persister_restarts)))
    if summary.skipped_checkpoints:
        rows.append(Row("skipped checkpoints", "\n".join(summary.skipped_checkpoints)))
    if summary.started_from_scratch:
        rows.append(Row("started from scratch", summary.started_from_scratch, alarm=True))
    if summary.not_written:
        rows.append(Row("not written", "\n".join(summary.not_written), alarm=True))
    failed = summary.failed_rank
    if failed is not None:
        where = f"rank {failed.rank} (node {failed.node}) {failed.description}"
        rows.append(Row("failed rank", where + (f"; its log: {failed.log}" if failed.log else "")))
    return rows


GOODPUT = "time training over wall time: start-up and recovery count against it"


def _goodput(summary: Summary) -> str:
    """The goodput with its definition and the figures it came from: a bare percentage reads
    as training efficiency, while a short job's start-up alone can take most of it."""
    goodput = summary.goodput
    if goodput is None:
        return f"unknown: no step reported ({GOODPUT})"
    lost = f"{summary.wall_s:.2f}s wall time - {summary.startup_s or 0.0:.2f}s start-up - "
    lost += f"{summary.downtime_s:.2f}s recovery"
    return f"{goodput:.1%}: {GOODPUT} (({lost}) / {summary.wall_s:.2f}s)"


FAULT_COLUMNS = ("fault", "class", "detail", "action", "restored from", "recovery", "steps lost")
FIRST_FAULTS = 5
LAST_FAULTS = 15
"""A summary lists the first and the last faults, one row each; the faults between are one
row that counts them by kind: a job through a thousand restarts prints a page, not a book."""


def fault_rows(
    summary: Summary, first: int = FIRST_FAULTS, last: int = LAST_FAULTS
) -> list[tuple[str, ...]]:
    """One row of :data:`FAULT_COLUMNS` a fault: the ``first`` ones and the ``last`` ones,
    and between them one row saying how many more there were, of which kinds."""
    faults = summary.faults
    if len(faults) <= first + last:
        return [_fault_row(f) for f in faults]
    between = faults[first : len(faults) - last]
    more = f"... {len(between)} more faults: {_by_kind(between)}"
    gap = ("...", "", more, "", "", "", "")
    return [
        *(_fault_row(f) for f in faults[:first]),
        gap,
        *(_fault_row(f) for f in faults[len(faults) - last :]),
    ]


def _fault_row(fault: Fault) -> tuple[str, ...]:
    recovery = "-" if fault.recovery_s is None else f"{fault.recovery_s:.2f}s"
    lost = "-" if fault.steps_lost is None else str(fault.steps_lost)
    if fault.steps_lost is not None and fault.lower_bound:
        lost = f"at least {lost}"
    verdict = f"{fault.fault_class}: {fault.reason}" if fault.fault_class else "-"
    restored = fault.restored_from or "-"
    return (fault.kind, verdict, fault.detail, fault.action, restored, recovery, lost)


def fault_kind(fault: Fault) -> str:
    """``worker_failed (transient)``: what faults are counted by."""
    return fault.kind + (f" ({fault.fault_class})" if fault.fault_class else "")


def _by_kind(faults: list[Fault]) -> str:
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault_kind(fault)] = counts.get(fault_kind(fault), 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{count} {kind}" for kind, count in ranked)


FAULT_KIND_COLUMNS = ("fault", "count", "recovered", "mean recovery", "steps lost")


def fault_kind_rows(summary: Summary) -> list[tuple[str, ...]]:
    """The faults counted by kind (and class), most frequent first: one row a kind."""
    kinds: dict[str, list[Fault]] = {}
    for fault in summary.faults:
        kinds.setdefault(fault_kind(fault), []).append(fault)
    rows: list[tuple[str, ...]] = []
    for kind, faults in sorted(kinds.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        took = [f.recovery_s for f in faults if f.recovery_s is not None]
        lost = [f.steps_lost for f in faults if f.steps_lost is not None]
        mean = f"{sum(took) / len(took):.2f}s" if took else "-"
        rows.append((kind, str(len(faults)), str(len(took)), mean, str(sum(lost)) if lost else "-"))
    return rows


STRAGGLER_COLUMNS = ("rank", "node", "measure", "per step", "others' median", "ratio")


def straggler_rows(summary: Summary) -> list[tuple[str, ...]]:
    return [
        (
            str(s.rank),
            s.node,
            s.metric,
            f"{s.seconds * 1000:.1f} ms",
            f"{s.others_s * 1000:.1f} ms",
            f"{s.ratio:.1f}x",
        )
        for s in summary.stragglers
    ]


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


TAIL = 1 << 20
"""Bytes of the timeline's end :func:`last_steps` reads: many samples of every node of a big
job, and a bounded read however long the job ran."""


def last_steps(path: Path, round_: int, tail: int = TAIL) -> dict[str, int]:
    """Each node's last sampled step of round ``round_`` in the timeline at ``path``, from
    its last ``tail`` bytes: what a resumed master knows of where training got before the
    master before it died. Lines that are no event (a partial last one) are passed over."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail))
            data = f.read()
    except OSError:
        return {}
    lines = data.split(b"\n")
    if size > tail:
        lines = lines[1:]  # the first is cut
    steps: dict[str, int] = {}
    for line in lines:
        if b'"progress"' not in line:
            continue
        try:
            event = JobEvent.from_line(line.decode("utf-8"))
        except (ValueError, TypeError):
            continue
        if (
            event.kind is EventKind.PROGRESS
            and event.node is not None
            and event.step is not None
            and event.data.get("round") == round_
        ):
            steps[event.node] = max(steps.get(event.node, -1), event.step)
    return steps


class Timeline:
    """Appends events to ``events.jsonl`` (0600) and hands each to ``observer``, then to those
    that :meth:`watch` it. An event that cannot be written (a full disk) is still handed on,
    and counted in :attr:`unwritten`: the job goes on, and its end is still told."""

    def __init__(self, path: Path, job: str, observer: Callable[[JobEvent], None]) -> None:
        self.path = path
        self.job = job
        self.observers = [observer]
        self.events: list[JobEvent] = []
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.unwritten = 0
        """Events that could not be written; :attr:`write_error` says why."""
        self.write_error = ""
        try:
            terminate(self._fd)
        except OSError as exc:  # a full disk: the next event's write says so too
            self.write_error = exc.strerror or str(exc)

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
        self._write((event.model_dump_json() + "\n").encode())
        for observer in self.observers:
            observer(event)
        return event

    def watch(self, observer: Callable[[JobEvent], None]) -> None:
        """Hand every later event to ``observer`` too (the master's metrics)."""
        self.observers.append(observer)

    def _write(self, line: bytes) -> None:
        try:
            written = os.write(self._fd, line)  # one append: no buffer holds a failed line
            if written < len(line):  # the disk filled mid-line: no partial line stays
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            self.unwritten += 1
            self.write_error = exc.strerror or str(exc)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def terminate(fd: int) -> None:
    """End the file of ``fd`` (open to read and append) with a newline if its last line has
    none: a master that died mid-write left a partial line, and the next event must start on
    a line of its own, not glue onto it (the damage would move into the middle of the
    timeline, and take a good event with it). The partial line is kept, not cut off: it may
    be a whole event that only lacks its newline; readers skip it if it is not."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")
