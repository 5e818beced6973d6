"""A run directory read back: what ``planaria report`` and ``planaria status`` read of a job.

The master writes the run directory (``planaria-runs/<run>/``): the timeline
(``events.jsonl``), its journal (``master.db``), its token, and at the end the summary. Readers
go through here, so that a file that is not what it should be is one clear error naming it,
never a traceback; a damaged line of the timeline is skipped with a warning naming the file
and the line, and the rest is read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple, TypeVar

from pydantic import ValidationError

from planaria import log
from planaria.errors import PlanariaError
from planaria.events import EventKind, JobEvent
from planaria.master.journal import NAME as JOURNAL_FILE
from planaria.master.summary import Summary, read_summary

EVENTS_FILE = "events.jsonl"
_log = log.get_logger("rundir")
T = TypeVar("T")


class RunDirError(PlanariaError):
    """A path is not a run directory, or a file of one cannot be read."""


def run_dir(path: Path) -> Path:
    """``path`` as a run directory (absolute); raises :class:`RunDirError` when it is none."""
    if not path.exists():
        raise RunDirError(f"{path} does not exist: give a run directory (planaria-runs/<run>)")
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory: give a run directory (planaria-runs/<run>)")
    if not (path / EVENTS_FILE).is_file() and not (path / JOURNAL_FILE).is_file():
        raise RunDirError(
            f"{path} is not a planaria run directory: it has neither {EVENTS_FILE} nor "
            f"{JOURNAL_FILE} (runs are in planaria-runs/<run> under the job's workdir)"
        )
    return path.absolute()


def read_events(path: Path) -> Iterator[JobEvent]:
    """The run's timeline, event by event, in order, read as it goes (a timeline of a week
    is gigabytes). A line that is not an event is skipped with a warning naming the file and
    the line: one damaged line (a crash mid-write) must not hide the rest."""
    return _read(path, parse_line)


def read_timeline(path: Path) -> Iterator[JobEvent | StepSample]:
    """:func:`read_events`, but each step sample (most of a timeline's lines) as a plain
    :class:`StepSample`: read without building its event, five times as quick."""
    return _read(path, _sample_or_event)


def _read(path: Path, parse: Callable[[bytes], T]) -> Iterator[T]:
    timeline = path / EVENTS_FILE
    try:
        f = timeline.open("rb")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunDirError(f"cannot read {timeline}: {exc.strerror or exc}") from None
    damaged = _Damaged(timeline)
    with f:
        for number, line in enumerate(_lines(f), start=1):
            if line is None:
                damaged.skip(f"line {number}", ValueError(TOO_LONG))
                continue
            if not line.strip():
                continue
            try:
                yield parse(line)
            except ValueError as exc:
                damaged.skip(f"line {number}", exc)
    damaged.done()


LONGEST = 16 << 20
"""A line longer than this is no event (the longest are a few kilobytes): it is skipped
without being held, so that a damaged file without newlines costs no more memory."""
TOO_LONG = f"longer than {LONGEST >> 20} MB, no event"


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """Each line of ``f``; None for one longer than :data:`LONGEST`, read past."""
    while line := f.readline(LONGEST + 1):
        if len(line) > LONGEST and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(BLOCK)
            yield None
        else:
            yield line


def events(path: Path) -> list[JobEvent]:
    """Every event of the run's timeline, in order (:func:`read_events`, kept in memory)."""
    return list(read_events(path))


def parse_line(line: bytes) -> JobEvent:
    """One line of a timeline as an event; :class:`ValueError` saying why when it is none."""
    try:
        return JobEvent.from_line(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(map(str, first["loc"])) or "<line>"
        raise ValueError(f"not a job event ({where}: {first['msg']})") from None


class StepSample(NamedTuple):
    """A ``progress`` event's figures: a node's step at a time, in a round; and rank 0's
    training loss with the step it was reported with, and the job's tokens so far, when the
    event carries them."""

    time: float
    node: str
    step: int
    round: int
    loss: float | None = None
    loss_step: int | None = None
    tokens: float | None = None


PROGRESS = b'{"kind":"progress"'
"""How a step sample's line starts, as the master writes it: its kind comes first."""
_PROGRESS_LINE = b"\n" + PROGRESS


def step_sample(line: bytes) -> StepSample | None:
    """The step sample of ``line`` when it is plainly one, as the master writes it; None
    when it is not, or not plainly (:func:`parse_line` then tells)."""
    if not line.startswith(PROGRESS):
        return None
    try:
        fields = json.loads(line)
        when, node, step, data = fields["time"], fields["node"], fields["step"], fields["data"]
        round_ = data["round"]
        loss, loss_step, tokens = data.get("loss"), data.get("loss_step"), data.get("tokens")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (
        type(when) in (float, int)
        and type(node) is str
        and type(step) is int
        and type(round_) is int
        and type(fields["job"]) is str
    ):
        return None
    count = finite(tokens)
    if tokens is not None and count is None:
        return None
    if loss is None and loss_step is None:
        return StepSample(float(when), node, step, round_, tokens=count)
    value = finite(loss)
    if value is not None and type(loss_step) is int:
        return StepSample(float(when), node, step, round_, value, loss_step, count)
    return None


def finite(value: object) -> float | None:
    """``value`` as a float when it is a finite number read from JSON (not a bool), else
    None: a loss (or a count of tokens) from a timeline someone else may have written."""
    if type(value) is float or type(value) is int:
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def _sample_or_event(line: bytes) -> JobEvent | StepSample:
    sample = step_sample(line)
    if sample is not None:
        return sample
    event = parse_line(line)
    if event.kind is EventKind.PROGRESS and event.node is not None and event.step is not None:
        data = event.data
        loss, loss_step = finite(data.get("loss")), data.get("loss_step")
        if loss is None or type(loss_step) is not int:
            loss = loss_step = None
        round_ = int(data.get("round", 0))
        tokens = finite(data.get("tokens"))
        return StepSample(event.time, event.node, event.step, round_, loss, loss_step, tokens)
    return event


class _Damaged:
    """Warns of the damaged lines skipped: each of the first few, then how many more."""

    SHOWN = 10

    def __init__(self, timeline: Path) -> None:
        self.timeline = timeline
        self.count = 0

    def skip(self, where: str, why: Exception) -> None:
        self.count += 1
        if self.count <= self.SHOWN:
            _log.warning(f"{self.timeline}, {where}: {why}; the line is skipped")

    def done(self) -> None:
        if self.count > self.SHOWN:
            more = self.count - self.SHOWN
            _log.warning(f"{self.timeline}: {more} more damaged line(s) skipped")


@dataclass
class Tail:
    """The end of a timeline: what ``planaria status`` shows of it."""

    events: list[JobEvent] = field(default_factory=list)
    """The last events that are no step samples, oldest first."""
    steps: dict[str, int] = field(default_factory=dict)
    """Each node's last step sampled, of the nodes asked for, where found."""


BLOCK = 1 << 20
STEPS_WITHIN = 16 << 20
"""How far from its end :func:`tail` looks for a node's last step: a node silent for longer
(one lost early in a long job) shows none, rather than the whole timeline being read."""
EVENTS_WITHIN = 256 << 20
"""How far from its end :func:`tail` looks for events: days of step samples of a job that
checkpointed nothing and had no fault; what is further back is for ``planaria report``."""


def tail(path: Path, count: int, nodes: Collection[str] = ()) -> Tail:
    """The last ``count`` events that are no step samples (within :data:`EVENTS_WITHIN` of
    the end), and the last step of each of ``nodes`` (within :data:`STEPS_WITHIN`), read
    from the end of the timeline backwards: its size does not matter (a block at a time; a
    block of step samples only is skipped unparsed). A damaged line is
    skipped with a warning counting it from the end (``tail -n`` finds it)."""
    timeline = path / EVENTS_FILE
    found = Tail()
    try:
        f = timeline.open("rb")
    except FileNotFoundError:
        return found
    except OSError as exc:
        raise RunDirError(f"cannot read {timeline}: {exc.strerror or exc}") from None
    damaged = _Damaged(timeline)
    wanted = set(nodes)
    recent: list[JobEvent] = []

    def take(line: bytes, number: int, near: bool) -> bool:
        """Whether ``line`` (the ``number``-th from the end) completes what is looked for."""
        if not line.strip():
            return False
        if line.startswith(PROGRESS) and not (near and wanted):
            return False
        try:
            event = _sample_or_event(line)
        except ValueError as exc:
            damaged.skip(f"line {number} from its end", exc)
            return False
        if isinstance(event, StepSample):
            if event.node in wanted:
                found.steps[event.node] = event.step
                wanted.discard(event.node)
        elif event.kind is not EventKind.PROGRESS and len(recent) < count:
            recent.append(event)
        return len(recent) >= count and not (near and wanted)

    with f:
        end = pos = f.seek(0, os.SEEK_END)
        carry = b""
        number = 0
        done = skipping = False
        while pos > 0 and not done:
            start = max(0, pos - BLOCK)
            near = end - start <= STEPS_WITHIN
            if (len(recent) >= count or end - pos >= EVENTS_WITHIN) and not (near and wanted):
                break
            if len(carry) > LONGEST:  # no event: read past its start, not held
                skipping, carry = True, b""
            f.seek(start)
            buffer = f.read(pos - start) + carry
            pos = start
            if skipping:
                cut = buffer.rfind(b"\n")
                if cut < 0:
                    continue
                buffer, skipping = buffer[:cut], False
                number += 1
                damaged.skip(f"line {number} from its end", ValueError(TOO_LONG))
            lines = buffer.count(b"\n")
            if not (near and wanted) and lines and buffer.count(_PROGRESS_LINE) == lines:
                carry = buffer[: buffer.index(b"\n")]  # all the rest: step samples
                number += lines
                continue
            pieces = buffer.split(b"\n")
            carry = pieces[0]
            for piece in reversed(pieces[1:]):
                if piece or number:
                    number += 1
                if take(piece, number, near):
                    done = True
                    break
        if not done and pos == 0:  # the first line of the file
            if skipping or len(carry) > LONGEST:
                damaged.skip(f"line {number + 1} from its end", ValueError(TOO_LONG))
            else:
                take(carry, number + 1, end <= STEPS_WITHIN)
    damaged.done()
    found.events = recent[::-1]
    return found


def summary(path: Path) -> Summary | None:
    """The summary the run wrote at its end; None when it wrote none."""
    try:
        return read_summary(path)
    except (OSError, ValueError) as exc:
        raise RunDirError(str(exc)) from None
