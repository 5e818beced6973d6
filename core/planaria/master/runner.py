"""Running one job to its end: the master and its API, the agents' launch, the job seen
through (:func:`supervise`), and a job taken over by a new master (:func:`resume_job`).

``planaria run`` and ``planaria check --preflight`` both run a job through :func:`run_job`;
the command line only parses its arguments and prints, and what it prints comes to it through
:class:`RunHooks`. What a config needs before a run may start, and what it makes of a job, is
:mod:`planaria.master.prepare`'s to say; the run directory's lock and token are
:mod:`planaria.master.claim`'s.

Why one module: a new run and a resumed one are one path (:func:`_run` serves the API and sees
the job through for both); what either does on the way is elsewhere, and what is left here is
the order of the steps and what is undone when one of them fails.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import signal
import sqlite3
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from planaria.config import ResolvedConfig, load_raw
from planaria.config.loader import RawConfig
from planaria.errors import ConfigError
from planaria.events import JobEvent
from planaria.log import get_logger
from planaria.master import scale
from planaria.master.advertise import Advertised, AdvertiseError, choose, is_wildcard, url_host
from planaria.master.binding import prover
from planaria.master.claim import TOKEN_FILE, lock_run_dir, read_token, write_token
from planaria.master.guard import Listener
from planaria.master.job import Master
from planaria.master.journal import NAME as JOURNAL_FILE
from planaria.master.journal import (
    Journal,
    JournalError,
    Journalled,
    damaged,
    ended_mark,
    existing,
    release_room,
)
from planaria.master.prepare import job_settings, job_spec, make_run_dir
from planaria.master.server import ServerLimits, make_app, serve
from planaria.master.state import JobState
from planaria.master.store import StoreHost
from planaria.master.summary import SUMMARY_FILE, Summary, write_summary
from planaria.master.tls import job_certificate, server_context
from planaria.master.transport import transport
from planaria.master.trust import check_private
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.protocol import (
    FINGERPRINT_ENV,
    MASTER_ENV,
    TOKEN_ENV,
    JobSpec,
    WorkersOutput,
)
from planaria.scheduler.api import LaunchSpec, Scheduler

TICK = 0.05
log = get_logger("master")


async def supervise(master: Master, launch: LaunchSpec | None) -> Summary:
    """Launch the job's nodes (``launch`` is what each runs: the agent; None: a resumed job's
    nodes run already) and see the job through: the scheduler's news, the ticks, and, once it
    ends, its nodes' exit."""
    if launch is not None:
        await master.launch(launch)
    spec = master.spec
    exit_deadline: float | None = None
    ticked = time.monotonic()
    failing = ""  # why the journal cannot be written, while it cannot
    while True:
        await asyncio.sleep(TICK)
        now = time.time()
        for event in await master.fleet.poll():
            master.node_event(event)
        seen, ticked = ticked, time.monotonic()
        master.fleet.renew_after_stall(ticked - seen)
        if not master.stopping:
            master.tick(now, ticked)
            try:
                master.journal_now()
                failing = ""
            except (sqlite3.Error, OSError) as exc:  # a full disk: training goes on
                if str(exc) != failing:
                    log.error("cannot write the journal; retrying every tick", error=str(exc))
                failing = str(exc)
            continue
        if exit_deadline is None:
            exit_deadline = now + spec.stop_grace + spec.heartbeat_interval + 2.0
        if master.fleet.settled() or now > exit_deadline:
            break
    # Replacements asked before the end come back first: nothing of the job's may write to
    # its timeline once this returns (the caller closes it).
    await master.fleet.close()
    master.journal_now()
    return master.summary()


def join_hold(heartbeat_timeout: float) -> float:
    """How long a rendezvous join is held waiting for its round: 5 s, and at most half the
    heartbeat timeout, since a node waiting in a join is heard from only when it asks again."""
    return min(5.0, heartbeat_timeout / 2)


def _ignore(*_: object) -> None:
    pass


async def _wait(master: Master, job: asyncio.Future[Summary]) -> Summary:
    return await job


@dataclass(frozen=True)
class RunHooks:
    """How the caller follows a run."""

    on_event: Callable[[JobEvent], None] = _ignore
    """Each event of the job, before the plugins' ``planaria_job_event`` get it."""
    on_start: Callable[[JobSpec, str], None] = _ignore
    """The job (its name, its run's id ...) and the master's URL, once the API listens."""
    on_warning: Callable[[str], None] = _ignore
    """What the user must hear before the job starts (an API open to the network)."""
    on_advertise: Callable[[Advertised], None] = _ignore
    """The address agents are told, and why, when the master chose it (the config binds
    every interface and advertises nothing)."""
    on_output: Callable[[WorkersOutput], None] = _ignore
    """Lines the workers wrote (:mod:`planaria.agent.console`), as they come."""
    follow: Callable[[Master, asyncio.Future[Summary]], Awaitable[Summary]] = field(default=_wait)
    """Awaits the running job and returns its summary; meanwhile it may show its status."""
    on_interrupt: Callable[[signal.Signals], None] = _ignore
    """The signal (SIGINT, SIGTERM) that stops the job, just before it does; not called for
    one that comes after the job ended."""


async def _advertised(
    resolved: ResolvedConfig, master: Master, journalled: Journalled | None
) -> Advertised:
    """What agents are told the master's address is (:mod:`planaria.master.advertise`): a
    resumed master keeps what its agents were told. A master that cannot tell is the
    config's problem (``master.advertise``); a new run then leaves nothing behind."""
    section = resolved.config.master
    server = (journalled.meta.get("server") or {}) if journalled is not None else {}
    if journalled is not None and server.get("advertise") and not section.advertise:
        return Advertised(str(server["advertise"]), "as the job's first master told its agents")
    try:
        # On the scheduler's thread: it may ask its cluster, and names may need looking up.
        return await master.fleet.call(
            choose,
            section.host,
            section.advertise,
            env=dict(os.environ),
            nodes=master.fleet.scheduler.node_addresses,
        )
    except AdvertiseError as exc:
        master.timeline.close()
        if journalled is None:
            shutil.rmtree(master.run_dir, ignore_errors=True)
        raise ConfigError([resolved.issue("master.advertise", str(exc))], resolved.source) from None


def _tls(
    resolved: ResolvedConfig, wanted: bool, master: Master, run_dir: Path, advertised: str
) -> tuple[ssl.SSLContext | None, dict[str, str]]:
    """The job's certificate (reused from ``run_dir`` when there) to serve with, naming
    ``advertised`` (what agents are told), and the agents' environment that pins it;
    nothing when ``wanted`` is false."""
    if not wanted:
        return None, {}
    section = resolved.config.master
    try:
        certificate = job_certificate(run_dir, [advertised, section.host])
        return server_context(certificate), {FINGERPRINT_ENV: certificate.fingerprint}
    except BaseException:
        master.timeline.close()
        raise


async def _serve(
    resolved: ResolvedConfig,
    app_: web.Application,
    master: Master,
    run_dir: Path,
    port: int | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[Listener, int]:
    """Serve the API (on ``port``, or the configured one; over TLS with ``tls``). An address
    or port this machine cannot give is the config's problem; a new run that could not start
    leaves nothing behind, its directory included."""
    host = resolved.config.master.host
    port = resolved.config.master.port if port is None else port
    resumed = master.journal is not None and master.state is not JobState.STARTING
    try:
        return await serve(app_, host, port, tls)
    except OSError as exc:
        master.timeline.close()
        if not resumed:
            shutil.rmtree(run_dir, ignore_errors=True)
        why = exc.strerror or str(exc)
        if resumed:
            where, hint = (
                "master.port",
                ("the resumed master must listen where its agents look for it: free that port"),
            )
        elif exc.errno == errno.EADDRINUSE:
            where, hint = "master.port", "choose another master.port, or 0 for any free one"
        else:
            where, hint = "master.host", "set master.host to an address of this machine"
        message = f"the master cannot listen on {host}:{port}: {why}; {hint}"
        raise ConfigError([resolved.issue(where, message)], resolved.source) from None


async def run_job(
    resolved: ResolvedConfig,
    manager: PluginManager,
    *,
    preflight_only: bool = False,
    hooks: RunHooks | None = None,
    token: str | None = None,
) -> tuple[Summary, Path]:
    """Run the job to its end: (its summary, its run directory). ``preflight_only``: only
    the pre-flight node check (no worker starts). SIGINT and SIGTERM stop the job. ``token``:
    the job's token when the nodes' launchers share one (nodes started outside); otherwise
    the job makes its own."""
    run_id, run_dir = make_run_dir(resolved)
    token = token or secrets.token_urlsafe(32)
    write_token(run_dir, token)
    lock = lock_run_dir(run_dir)
    try:
        spec = job_spec(resolved, run_id, run_dir, preflight_only)
        dump = resolved.dump()
        dump["job"]["workdir"] = spec.workdir  # absolute: a resumed master may run elsewhere
        journal = Journal.create(
            run_dir,
            {"config": dump, "source": resolved.source, "spec": spec.model_dump(mode="json")},
        )
        master = _master(resolved, manager, spec, run_dir, hooks or RunHooks(), preflight_only)
        master.keep_journal(journal)
    except BaseException:
        os.close(lock)
        raise
    return await _run(resolved, master, token, hooks or RunHooks(), None, lock), run_dir


async def resume_job(run_dir: Path, hooks: RunHooks | None = None) -> tuple[Summary, Path]:
    """Take over the job of ``run_dir`` whose master died (``planaria run --resume``): its
    config, state and nodes come from the run directory's journal; the agents, which kept
    their workers training, re-attach. Raises :class:`JournalError` (or ``ConfigError``) when
    there is nothing to resume, the run directory is not this user's alone, another master
    holds it, or its journal is damaged: all of it before anything is written there."""
    hooks = hooks or RunHooks()
    run_dir = run_dir.absolute()
    journal_path = existing(run_dir)
    check_private(run_dir, [JOURNAL_FILE, f"{JOURNAL_FILE}-wal", f"{JOURNAL_FILE}-shm", TOKEN_FILE])
    lock = lock_run_dir(run_dir)
    journal = None
    try:
        ended = ended_mark(run_dir)
        if ended is not None:  # its journal may say running: the disk was full at the end
            raise JournalError(
                f"the job of {run_dir} has ended ({ended}, as its end mark job.ended-{ended} "
                "says): there is nothing to resume"
            )
        journal, journalled = Journal.open(run_dir)
        with damaged(journal_path, "part 'job'"):
            job = journalled.parts.get("job", {})
            state = JobState(job.get("state", JobState.STARTING.value))
        if state.terminal:
            raise JournalError(
                f"the job of {run_dir} has ended ({state.value}: {job.get('reason', '')}): "
                "there is nothing to resume"
            )
        if state in (JobState.STARTING, JobState.PREFLIGHT):
            raise JournalError(
                f"the master of {run_dir} died before its job began training ({state.value}): "
                "start the job again instead"
            )
        with damaged(journal_path, "its meta"):
            config, spec_ = journalled.meta["config"], journalled.meta["spec"]
        raw = RawConfig(config, source=f"{journal_path} (the journalled config)")
        resolved, manager = load_raw(raw)
        with damaged(journal_path, "its meta 'spec'"):
            spec = JobSpec.model_validate(spec_)
        token = read_token(run_dir)
        master = _master(resolved, manager, spec, run_dir, hooks, preflight_only=False)
        try:
            master.resume(journalled)
        except BaseException:
            master.timeline.close()
            raise
    except BaseException:
        if journal is not None:
            journal.close()
        os.close(lock)
        raise
    journal.keep_room()
    master.keep_journal(journal)
    server = journalled.meta.get("server") or {}
    summary = await _run(resolved, master, token, hooks, journalled, lock, port=server.get("port"))
    return summary, run_dir


def _master(
    resolved: ResolvedConfig,
    manager: PluginManager,
    spec: JobSpec,
    run_dir: Path,
    hooks: RunHooks,
    preflight_only: bool,
) -> Master:
    chosen = resolved.backends["scheduler"]
    scheduler: Scheduler[Any] = manager.build(
        PluginKind.SCHEDULER,
        {"backend": chosen.record.name, "options": chosen.options},
        path="scheduler",
    )

    def observe(event: JobEvent) -> None:
        hooks.on_event(event)
        manager.emit(event)

    settings = job_settings(resolved, manager, spec, preflight_only)
    master = Master(settings, scheduler, run_dir, observe)
    master.on_output = hooks.on_output
    return master


async def _run(
    resolved: ResolvedConfig,
    master: Master,
    token: str,
    hooks: RunHooks,
    journalled: Journalled | None,
    lock: int,
    port: int | None = None,
) -> Summary:
    """Serve the job's API and see the job through; ``lock``: the run directory's master
    lock, held until the end."""
    config = resolved.config
    run_dir = master.run_dir
    try:
        limits = ServerLimits(
            request_timeout=config.master.request_timeout,
            per_client=config.master.max_connections_per_client,
            max_request_bytes=config.master.max_request_bytes,
        )
        scale.prepare(master.settings.max_nodes)
        wire = transport(config.master.host, config.master.tls)
        advertised = await _advertised(resolved, master, journalled)
        # The same again on a resume.
        tls, pin = _tls(resolved, wire.tls, master, run_dir, advertised.address)
        fingerprint = pin.get(FINGERPRINT_ENV)
        app_ = make_app(
            master,
            token,
            hold=config.master.heartbeat_interval,
            limits=limits,
            join_hold=join_hold(config.master.heartbeat_timeout),
            public_with=["master.metrics_public"] if config.master.metrics_public else [],
            binding=None if fingerprint is None else prover(token, fingerprint),
        )
        server, port = await _serve(resolved, app_, master, run_dir, port, tls)
        assert master.journal is not None
        url = f"{wire.scheme}://{url_host(advertised.address)}:{port}"
        # Where `planaria status` asks (and a resumed master listens again).
        master.journal.set_meta(
            "server",
            {
                "host": config.master.host,
                "port": port,
                "url": url,
                "advertise": advertised.address,
            },
        )
        if wire.warning:
            hooks.on_warning(wire.warning)
        if not config.master.advertise and is_wildcard(config.master.host):
            log.info("master address chosen", address=advertised.address, why=advertised.why)
            hooks.on_advertise(advertised)
        agents = LaunchSpec(
            job=master.spec.job,
            command=(sys.executable, "-m", "planaria", "agent"),
            # The URL, the token and the pinned fingerprint: never shown in a command line.
            env={MASTER_ENV: url, TOKEN_ENV: token, **pin},
            log_dir=run_dir / "logs" / "agents",
            run_id=master.spec.run_id,
            detached=True,
        )
        hooks.on_start(master.spec, url)
        loop = asyncio.get_running_loop()

        def interrupt(sig: signal.Signals) -> None:
            if not master.state.terminal:
                hooks.on_interrupt(sig)
            master.stop(f"interrupted by {sig.name}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt, sig)
        try:
            if master.settings.store == "master":  # imports torch now, off the recovery path
                master.store = StoreHost(advertised.address, run_dir / "logs" / "store.log")
                master.store.start()
            if journalled is not None:
                master.announce_resume()
                await master.adopt(agents, journalled)
            job = asyncio.ensure_future(supervise(master, None if journalled else agents))
            summary = await hooks.follow(master, job)
            try:
                write_summary(run_dir, summary)
            except OSError as exc:  # the job's result stands: the caller prints it all the same
                master.could_not_write(SUMMARY_FILE, exc)
                summary = master.summary()
            return summary
        finally:
            if master.store is not None:
                master.store.close()
            await server.cleanup()
            master.timeline.close()
            master.journal.close()
            if master.state.terminal:
                release_room(run_dir)
    finally:
        os.close(lock)
