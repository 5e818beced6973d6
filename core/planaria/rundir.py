"""A run directory read back: what ``planaria report`` and ``planaria status`` read of a job.

The master writes the run directory (``planaria-runs/<run>/``): the timeline
(``events.jsonl``), its journal (``master.db``), its token, and at the end the summary. Readers
go through here, so that a file that is not what it should be is one clear error naming it
(and the line, for the timeline), never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from planaria.errors import PlanariaError
from planaria.events import JobEvent
from planaria.master.journal import NAME as JOURNAL_FILE
from planaria.master.timeline import Summary, read_summary

EVENTS_FILE = "events.jsonl"


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


def events(path: Path) -> list[JobEvent]:
    """Every event of the run's timeline, in order. A line that is not an event is an error
    naming the file and the line."""
    timeline = path / EVENTS_FILE
    try:
        text = timeline.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise RunDirError(f"cannot read {timeline}: {exc}") from None
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            found.append(JobEvent.from_line(line))
        except json.JSONDecodeError as exc:
            raise RunDirError(
                f"{timeline}, line {number}: not JSON ({exc.msg} at column {exc.colno}); the "
                "timeline is damaged"
            ) from None
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(map(str, first["loc"])) or "<line>"
            raise RunDirError(
                f"{timeline}, line {number}: not a job event ({where}: {first['msg']}); the "
                "timeline is damaged"
            ) from None
    return found


def summary(path: Path) -> Summary | None:
    """The summary the run wrote at its end; None when it wrote none."""
    try:
        return read_summary(path)
    except (OSError, ValueError) as exc:
        raise RunDirError(str(exc)) from None
