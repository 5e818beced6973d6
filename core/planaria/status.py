"""Where a job stands, for ``planaria status``: asked of its master while it runs
(``GET /v1/status`` with the job's token), read from its run directory once it is over.

The run directory says where its master listens (the journal's ``server`` entry), holds the
token (``token``, 0600) and the certificate an HTTPS master must show (``tls/cert.pem``, pinned
by its fingerprint as agents pin it: the master may be bound to every interface, asked by any
of its addresses).
A master that does not answer there is gone: the journal then tells the job's last state, and
the timeline each node's last step. Only the end of the timeline is read: the recent events
and the last steps are there, and a long job's timeline is gigabytes.
"""

from __future__ import annotations

import hmac
import http.client
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from planaria import rundir
from planaria.errors import PlanariaError
from planaria.events import JobEvent
from planaria.master.claim import TOKEN_FILE
from planaria.master.journal import NAME as JOURNAL_FILE
from planaria.master.journal import Journal, JournalError, Journalled, damaged, ended_mark
from planaria.master.state import JobState
from planaria.master.tls import (
    CERT_NAME,
    CertificateError,
    peer_fingerprint,
    pinning_context,
    recorded_fingerprint,
)
from planaria.protocol import API_PREFIX, FINGERPRINT_ENV, TOKEN_ENV, JobStatus, NodeStatus

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
    if url is not None:
        try:
            status = ask(url, token_of(where), where)
            events = rundir.tail(where, recent).events
            return JobView(status, running=True, source=url, events=events)
        except MasterGone:
            if master is not None:
                raise
    journalled = _journalled(where)
    tail = rundir.tail(where, recent, nodes=journalled.nodes)
    status = ended(where, tail.steps, journalled)
    return JobView(status, running=False, source=str(where), events=tail.events)


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
    """``GET /v1/status`` of the master at ``url``. An HTTPS master must show the job's
    certificate: the one in ``run_dir/tls/`` (else the fingerprint in ``PLANARIA_MASTER_
    FINGERPRINT``), pinned by its fingerprint as agents pin it, whatever address is asked.
    Raises :class:`MasterGone` when nothing answers there, :class:`StatusError` for any other
    failure."""
    parsed = urlsplit(url)
    pin = _pin(url, run_dir) if parsed.scheme == "https" else None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise StatusError(f"the master's URL {url!r} is neither http://HOST:PORT nor https://")
    try:
        port = parsed.port
    except ValueError:
        raise StatusError(f"the master's URL {url!r} has no valid port") from None
    connection: http.client.HTTPConnection
    if pin is None:
        connection = http.client.HTTPConnection(parsed.hostname, port, timeout=TIMEOUT)
    else:
        connection = http.client.HTTPSConnection(
            parsed.hostname, port, timeout=TIMEOUT, context=pinning_context()
        )
    path = f"{parsed.path.rstrip('/')}{API_PREFIX}/status"
    try:
        connection.connect()
        if pin is not None:
            assert isinstance(connection.sock, ssl.SSLSocket)
            _check_pin(url, run_dir, pin, peer_fingerprint(connection.sock))
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        reply = connection.getresponse()
        body = reply.read()
    except ssl.SSLError as exc:
        raise StatusError(f"cannot speak TLS with the master at {url}: {exc}") from None
    except TimeoutError:  # there, but busy or stopped: not gone
        raise StatusError(f"the master at {url} did not answer within {TIMEOUT:g}s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise MasterGone(f"no master answers at {url}: {exc}") from None
    finally:
        connection.close()
    if reply.status != 200:
        raise StatusError(f"the master at {url} answered {reply.status}: {reply.reason}")
    try:
        return JobStatus.model_validate_json(body)
    except ValidationError as exc:
        raise StatusError(f"the master at {url} answered no job status: {exc}") from None


def _pin(url: str, run_dir: Path | None) -> str:
    """The fingerprint an HTTPS master at ``url`` must show: the run directory's, else the
    one in the environment (as an agent's)."""
    if run_dir is not None:
        try:
            return recorded_fingerprint(run_dir)
        except CertificateError as exc:
            raise StatusError(f"{url} is HTTPS, and {exc}") from None
    given = os.environ.get(FINGERPRINT_ENV, "").strip().lower()
    if not given:
        raise StatusError(
            f"{url} is HTTPS: give the run directory, whose tls/{CERT_NAME} it must show, or "
            f"the SHA-256 fingerprint of its certificate in {FINGERPRINT_ENV}"
        )
    if len(given) != 64 or any(c not in "0123456789abcdef" for c in given):
        raise StatusError(
            f"{FINGERPRINT_ENV} must be the 64 hex digits of a SHA-256, got {len(given)} characters"
        )
    return given


def _check_pin(url: str, run_dir: Path | None, expected: str, got: str) -> None:
    if not hmac.compare_digest(expected, got):
        whose = FINGERPRINT_ENV if run_dir is None else str(run_dir / "tls" / CERT_NAME)
        raise StatusError(
            f"the server at {url} is not this job's master: its certificate's SHA-256 is "
            f"{got[:16]}..., the job's is {expected[:16]}... ({whose}); nothing was sent to it"
        )


def ended(run_dir: Path, steps: dict[str, int], journalled: Journalled | None = None) -> JobStatus:
    """The job's last state from its journal; each node's last step as ``steps`` says (the
    end of the timeline: :func:`planaria.rundir.tail`)."""
    journalled = journalled or _journalled(run_dir)
    try:
        with damaged(run_dir / JOURNAL_FILE, "its parts"):
            return _ended(run_dir, journalled, steps)
    except JournalError as exc:
        raise StatusError(str(exc)) from None


def _ended(run_dir: Path, journalled: Journalled, steps: dict[str, int]) -> JobStatus:
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
            f"the master journal {run_dir / JOURNAL_FILE} is damaged: part 'job', 'state' is "
            f"{state!r}, not a state this planaria knows"
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
    nodes = [
        NodeStatus(
            node_id=node_id,
            host=str(record.get("host", "")),
            state=str(record.get("phase", "")),
            node_rank=(world.get(node_id) or {}).get("node_rank"),
            step=steps.get(node_id, -1),
            topology=_topology(journalled.handles.get(node_id)),
        )
        for node_id, record in journalled.nodes.items()
    ]
    # Steps done as the summary counted them, else as the master would have: from the first
    # step reported (the journal keeps it) to the last one sampled.
    first = int(job.get("first_step", 0) or 0)
    summary = rundir.summary(run_dir)
    sampled = max((n.step for n in nodes), default=-1)
    if summary is not None:
        done = summary.steps
    else:
        done = max(0, sampled - first + 1) if sampled >= 0 else 0
    last = first + done - 1 if done else -1
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
        steps_done=done,
    )


def _topology(handle: dict[str, Any] | None) -> dict[str, str]:
    """A journalled scheduler handle's topology labels; none when it has none (a run of a
    planaria before labels, or a scheduler that gives none)."""
    labels = (handle or {}).get("topology") or {}
    if not isinstance(labels, dict):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def _journalled(run_dir: Path) -> Journalled:
    """The journal read without writing: a live master's is left alone, and a run on a
    read-only mount can still be read."""
    try:
        return Journal.read(run_dir)
    except JournalError as exc:
        raise StatusError(str(exc)) from None
