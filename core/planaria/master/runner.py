"""Running one job to its end: the run directory, the master and its API, the agents' launch.

``planaria run`` and ``planaria check --preflight`` both run a job through :func:`run_job`;
the command line only parses its arguments and prints, and what it prints comes to it through
:class:`RunHooks`. What a config needs before a run may start is :func:`run_issues`'s to say.
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from planaria.config import ResolvedConfig
from planaria.config.machine import machine_issues, workdir_issues
from planaria.diagnosis.setup import BENCHMARK_PATH, agent_spec, master_policy
from planaria.errors import ConfigError, ConfigIssue
from planaria.events import JobEvent
from planaria.master.job import Master
from planaria.master.server import ServerLimits, make_app, serve
from planaria.master.state import JobSettings
from planaria.master.timeline import Summary
from planaria.master.transport import transport
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.protocol import MASTER_ENV, TOKEN_ENV, CheckpointSpec, JobSpec
from planaria.scheduler.api import LaunchSpec, Scheduler

TICK = 0.05


async def supervise(master: Master, launch: LaunchSpec) -> Summary:
    """Launch the job's nodes (``launch`` is what each runs: the agent) and see the job
    through: the scheduler's news, the ticks, and, once it ends, its nodes' exit."""
    await master.launch(launch)
    spec = master.spec
    exit_deadline: float | None = None
    ticked = time.monotonic()
    while True:
        await asyncio.sleep(TICK)
        now = time.time()
        for event in await master.fleet.poll():
            master.node_event(event)
        seen, ticked = ticked, time.monotonic()
        master.fleet.renew_after_stall(ticked - seen)
        if not master.stopping:
            master.tick(now, ticked)
            continue
        if exit_deadline is None:
            exit_deadline = now + spec.stop_grace + spec.heartbeat_interval + 2.0
        if master.fleet.settled() or now > exit_deadline:
            break
    # Replacements asked before the end come back first: nothing of the job's may write to
    # its timeline once this returns (the caller closes it).
    await master.fleet.close()
    return master.summary()


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
    follow: Callable[[Master, asyncio.Future[Summary]], Awaitable[Summary]] = field(default=_wait)
    """Awaits the running job and returns its summary; meanwhile it may show its status."""


def preflight_issues(resolved: ResolvedConfig, asked: bool = False) -> list[ConfigIssue]:
    """The pre-flight check needs its benchmark installed, when it is on (or ``asked``)."""
    diagnosis = resolved.config.diagnosis
    if (diagnosis.preflight or asked) and BENCHMARK_PATH not in resolved.backends:
        name = diagnosis.preflight_benchmark.backend
        return [
            ConfigIssue(f"{BENCHMARK_PATH}.backend", f"node benchmark {name!r} is not installed")
        ]
    return []


def scheduler_issues(resolved: ResolvedConfig) -> list[ConfigIssue]:
    if "scheduler" in resolved.backends:
        return []
    backend = resolved.config.scheduler.backend
    return [ConfigIssue("scheduler.backend", f"scheduler {backend!r} is not installed")]


def run_issues(resolved: ResolvedConfig) -> list[ConfigIssue]:
    """What keeps a valid config from running a job here: a missing command, plugin or
    program, a rendezvous the master cannot form."""
    issues = []
    if not resolved.config.job.command:
        issues.append(
            ConfigIssue("job.command", "no training command: set it, or give it after --")
        )
    issues += scheduler_issues(resolved)
    issues += preflight_issues(resolved)
    issues += machine_issues(resolved)
    return issues


def _run_dir(resolved: ResolvedConfig) -> tuple[str, Path]:
    job = resolved.config.job
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = f"{job.name}-{stamp}-{secrets.token_hex(2)}"
    run_dir = (job.workdir / job.run_dir / run_id).absolute()
    issues = workdir_issues(resolved)  # never made here: a missing one is a mistake
    if issues:
        raise ConfigError(issues, resolved.source)
    try:
        (run_dir / "logs").mkdir(parents=True, mode=0o700)
    except OSError as exc:
        message = (
            f"cannot create the run directory {run_dir}: {exc.strerror or exc}; set "
            "job.run_dir to a directory this user can write"
        )
        raise ConfigError([resolved.issue("job.run_dir", message)], resolved.source) from None
    return run_id, run_dir


def _checkpoint_spec(resolved: ResolvedConfig, run_dir: Path) -> CheckpointSpec:
    """The checkpoint section for agents and workers. A relative ``local`` path is taken
    relative to the run's directory, so each run starts fresh unless the config names a
    directory of its own (an absolute path: a new run then resumes from it)."""
    section = resolved.config.checkpoint
    storage = resolved.backends["checkpoint.storage"]
    options = storage.options.model_dump(mode="json")
    if storage.record.name == "local" and not Path(options["path"]).expanduser().is_absolute():
        options["path"] = str(run_dir / options["path"])
    return CheckpointSpec(
        storage={
            "backend": storage.record.name,
            "options": options,
            "plugin": storage.plugin,
            "disable": list(resolved.config.plugins.disable),
        },
        keep_last=section.keep_last,
        persist_every=section.persist_every,
        persist_on_fault=section.persist_on_fault,
        require_restore=section.require_restore,
        allow_unpersisted_end=section.allow_unpersisted_end,
    )


def _job_spec(
    resolved: ResolvedConfig, run_id: str, run_dir: Path, preflight_only: bool
) -> JobSpec:
    config = resolved.config
    job = config.job
    return JobSpec(
        job=job.name,
        run_id=run_id,
        run_dir=str(run_dir),
        # The check alone never starts a worker; the launcher wants a command all the same.
        command=[sys.executable, "-c", "pass"] if preflight_only else job.command,
        workdir=str(job.workdir.absolute()),
        env=job.env,
        procs_per_node=job.procs_per_node,
        max_restarts=job.max_restarts,
        heartbeat_interval=config.master.heartbeat_interval,
        heartbeat_timeout=config.master.heartbeat_timeout,
        stop_grace=job.stop_grace,
        preload=[] if preflight_only else job.preload,
        chaos=config.chaos,
        checkpoint=None if preflight_only else _checkpoint_spec(resolved, run_dir),
        diagnosis=agent_spec(resolved, preflight_only),
    )


async def _serve(
    resolved: ResolvedConfig, app_: web.Application, master: Master, run_dir: Path
) -> tuple[web.AppRunner, int]:
    """Serve the API. An address or port this machine cannot give is the config's problem;
    the run that could not start leaves nothing behind, its directory included."""
    host, port = resolved.config.master.host, resolved.config.master.port
    try:
        return await serve(app_, host, port)
    except OSError as exc:
        master.timeline.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
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
) -> tuple[Summary, Path]:
    """Run the job to its end: (its summary, its run directory). ``preflight_only``: only
    the pre-flight node check (no worker starts). SIGINT and SIGTERM stop the job."""
    hooks = hooks or RunHooks()
    config = resolved.config
    job = config.job
    run_id, run_dir = _run_dir(resolved)
    token = secrets.token_urlsafe(32)
    chosen = resolved.backends["scheduler"]
    scheduler: Scheduler[Any] = manager.build(
        PluginKind.SCHEDULER,
        {"backend": chosen.record.name, "options": chosen.options},
        path="scheduler",
    )

    def observe(event: JobEvent) -> None:
        hooks.on_event(event)
        manager.emit(event)

    settings = JobSettings(
        spec=_job_spec(resolved, run_id, run_dir, preflight_only),
        min_nodes=job.nodes.min,
        max_nodes=job.nodes.max,
        node_unit=job.node_unit,
        join_grace=config.rendezvous.join_grace,
        join_timeout=config.rendezvous.join_timeout,
        diagnosis=master_policy(resolved, manager, preflight_only),
    )
    master = Master(settings, scheduler, run_dir, observe)
    limits = ServerLimits(
        request_timeout=config.master.request_timeout,
        per_client=config.master.max_connections_per_client,
        max_request_bytes=config.master.max_request_bytes,
    )
    app_ = make_app(master, token, hold=config.master.heartbeat_interval, limits=limits)
    server, port = await _serve(resolved, app_, master, run_dir)
    wire = transport(config.master.host)
    if wire.warning:
        hooks.on_warning(wire.warning)
    advertise = config.master.advertise or config.master.host
    url = f"{wire.scheme}://{advertise}:{port}"
    agents = LaunchSpec(
        job=job.name,
        command=(sys.executable, "-m", "planaria", "agent"),
        env={MASTER_ENV: url, TOKEN_ENV: token},  # the token never shows in a command line
        log_dir=run_dir / "logs" / "agents",
        run_id=run_id,
    )
    hooks.on_start(settings.spec, url)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.stop, f"interrupted by {signal.Signals(sig).name}")
    try:
        summary = await hooks.follow(master, asyncio.ensure_future(supervise(master, agents)))
    finally:
        await server.cleanup()
        master.timeline.close()
    return summary, run_dir
