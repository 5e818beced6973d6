"""Where a job stands, for ``planaria status``: asked of its master while it runs
(``GET /v1/status`` with the job's token), read from its run directory once it is over.

The run directory says where its master listens (the journal's ``server`` entry), holds the
token (``token``, 0600) and the certificate to verify an HTTPS master by (``tls/cert.pem``).
A master that does not answer there is gone: the journal then tells the job's last state, and
the timeline each node's last step.
"""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planaria import rundir
from planaria.errors import PlanariaError
from planaria.events import EventKind, JobEvent
from planaria.master.journal import Journal, JournalError, ended_mark
from planaria.master.runner import TOKEN_FILE
from planaria.master.state import JobState
from planaria.master.tls import CERT_NAME
from planaria.protocol import API_PREFIX, TOKEN_ENV, JobStatus, NodeStatus

TIMEOUT = 5.0
RECENT = 10
"""Events shown by default: the last ones, step samples left out."""


class StatusError(PlanariaError):
    """The job's state cannot be had: no master answers and there is no run to read, a
    token is missing, or the master refuses it."""


class MasterGone(StatusError):
    """Nothing listens at the master's address."""


@dataclass
class JobView:
    status: JobStatus
    running: bool
    """Whether its master answered (else the job is over, or its master died)."""
    source: str
    """The master's URL, or the run directory read."""
    events: list[JobEvent] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "source": self.source,
            **self.status.model_dump(mode="json"),
            "events": [e.model_dump(mode="json") for e in self.events],
        }


def view(run_dir: Path | None, master: str | None = None, recent: int = RECENT) -> JobView:
    """The job of ``run_dir`` (or of the master at ``master``) as it stands now."""
    where = None if run_dir is None else rundir.run_dir(run_dir)
    if where is None:
        if master is None:
            raise StatusError("give a run directory, or --master URL")
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise StatusError(f"--master without a run directory takes the token from {TOKEN_ENV}")
        return JobView(ask(master, token, None), running=True, source=master)
    url = master or master_url(where)
    events = rundir.events(where)
    if url is not None:
        try:
            status = ask(url, token_of(where), where)
            return JobView(status, running=True, source=url, events=_recent(events, recent))
        except MasterGone:
            if master is not None:
                raise
    return JobView(
        ended(where, events), running=False, source=str(where), events=_recent(events, recent)
    )


def master_url(run_dir: Path) -> str | None:
    """Where the master of ``run_dir`` listens (it writes it in its journal once it does)."""
    server = _journalled(run_dir).meta.get("server") or {}
    if "url" in server:
        return str(server["url"])
    if "port" in server:  # a run of a planaria before the URL was journalled
        return f"http://{server.get('host', '127.0.0.1')}:{server['port']}"
    return None


def token_of(run_dir: Path) -> str:
    path = run_dir / TOKEN_FILE
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise StatusError(f"cannot read the job's token {path}: {exc.strerror or exc}") from None


def ask(url: str, token: str, run_dir: Path | None) -> JobStatus:
    """``GET /v1/status`` of the master at ``url``. Raises :class:`MasterGone` when nothing
    answers there, :class:`StatusError` for any other failure."""
    context = None
    if url.startswith("https://"):
        if run_dir is None:
            raise StatusError(
                f"{url} is HTTPS: give the run directory, whose tls/{CERT_NAME} verifies it"
            )
        context = ssl.create_default_context(cafile=str(run_dir / "tls" / CERT_NAME))
    request = urllib.request.Request(
        f"{url.rstrip('/')}{API_PREFIX}/status", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT, context=context) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        raise StatusError(f"the master at {url} answered {exc.code}: {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLError):
            raise StatusError(f"cannot verify the master at {url}: {reason}") from None
        if isinstance(reason, TimeoutError):  # there, but busy or stopped: not gone
            raise StatusError(f"the master at {url} did not answer within {TIMEOUT:g}s") from None
        raise MasterGone(f"no master answers at {url}: {reason}") from None
    try:
        return JobStatus.model_validate_json(body)
    except ValidationError as exc:
        raise StatusError(f"the master at {url} answered no job status: {exc}") from None


def ended(run_dir: Path, events: list[JobEvent]) -> JobStatus:
    """The job's last state from its journal; each node's last step from the timeline."""
    journalled = _journalled(run_dir)
    parts, meta = journalled.parts, journalled.meta
    job = parts.get("job") or {}
    spec = meta.get("spec") or {}
    rounds = parts.get("rounds") or {}
    world = rounds.get("world") or {}
    state = str(job.get("state", JobState.STARTING.value))
    reason = str(job.get("reason", ""))
    try:
        known = JobState(state)
    except ValueError:
        raise StatusError(
            f"the journal of {run_dir} says the job is {state!r}: not a state this planaria knows"
        ) from None
    mark = ended_mark(run_dir)
    if not known.terminal and mark is not None:  # the end came, the journal missed it
        state = mark
        reason = (
            f"the job ended ({mark}) but its journal could not record it (a full disk?); "
            "its summary.json says more, when it could be written"
        )
    elif not known.terminal:
        reason = (
            f"its master is gone (the job was {state} when it last wrote its journal): "
            f"resume it with planaria run --resume {run_dir}"
        )
        state = "master gone"
    steps: dict[str, int] = {}
    for event in events:
        if event.kind is EventKind.PROGRESS and event.node is not None and event.step is not None:
            steps[event.node] = event.step
    nodes = [
        NodeStatus(
            node_id=node_id,
            host=str(record.get("host", "")),
            state=str(record.get("phase", "")),
            node_rank=(world.get(node_id) or {}).get("node_rank"),
            step=steps.get(node_id, -1),
        )
        for node_id, record in journalled.nodes.items()
    ]
    summary = rundir.summary(run_dir)
    last = summary.steps - 1 if summary is not None else -1
    return JobStatus(
        job=str(spec.get("job", "")),
        run_id=str(spec.get("run_id", run_dir.name)),
        state=state,
        round=int(rounds.get("round", 0)),
        restarts=int((parts.get("recovery") or {}).get("restarts", 0)),
        max_restarts=int(spec.get("max_restarts", 0)),
        step=max([last, *(n.step for n in nodes if n.node_rank is not None)]),
        nodes=sorted(nodes, key=lambda n: n.node_id),
        reason=reason,
    )


def _journalled(run_dir: Path) -> Any:
    try:
        journal, journalled = Journal.open(run_dir)
    except JournalError as exc:
        raise StatusError(str(exc)) from None
    journal.close()
    return journalled


def _recent(events: list[JobEvent], count: int) -> list[JobEvent]:
    return [e for e in events if e.kind is not EventKind.PROGRESS][-count:] if count else []
