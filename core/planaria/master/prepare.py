"""A config made into a job: what keeps it from running here (:func:`run_issues`), its run
directory, the spec its agents and workers get and the master's settings. Nothing here starts
anything; :mod:`planaria.master.runner` runs what this makes."""

from __future__ import annotations

import datetime
import secrets
import sys
from pathlib import Path
from typing import Any

from planaria.config import ResolvedConfig
from planaria.config.machine import machine_issues, workdir_issues
from planaria.diagnosis.setup import BENCHMARK_PATH, agent_spec, master_policy
from planaria.errors import ConfigError, ConfigIssue
from planaria.master.state import JobSettings
from planaria.plugin.manager import PluginManager
from planaria.protocol import CheckpointSpec, JobSpec, ReplicaSpec
from planaria.rendezvous.api import RankPlacement
from planaria.rendezvous.builtin import StablePlacement


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


def make_run_dir(resolved: ResolvedConfig) -> tuple[str, Path]:
    job = resolved.config.job
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = f"{job.name}-{stamp}-{secrets.token_hex(2)}"
    run_dir = (job.workdir / job.run_dir / run_id).absolute()
    issues = workdir_issues(resolved)  # never made here: a missing one is a mistake
    if issues:
        raise ConfigError(issues, resolved.source)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(mode=0o700)  # private: it holds the job's token and its key
        (run_dir / "logs").mkdir(mode=0o700)
    except OSError as exc:
        message = (
            f"cannot create the run directory {run_dir}: {exc.strerror or exc}; set "
            "job.run_dir to a directory this user can write"
        )
        raise ConfigError([resolved.issue("job.run_dir", message)], resolved.source) from None
    logs = worker_log_dir(resolved, run_id, run_dir)
    try:
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        message = f"cannot create the log directory {logs}: {exc.strerror or exc}"
        raise ConfigError([resolved.issue("job.logs.dir", message)], resolved.source) from None
    return run_id, run_dir


def worker_log_dir(resolved: ResolvedConfig, run_id: str, run_dir: Path) -> Path:
    """Where the workers' logs go: the run's ``logs/``, or a folder of the run's in
    ``job.logs.dir`` (torchrun's ``--log-dir`` also keeps each run apart)."""
    job = resolved.config.job
    if job.logs.dir is None:
        return run_dir / "logs"
    return (job.workdir / job.logs.dir / run_id).absolute()


def checkpoint_spec(resolved: ResolvedConfig, run_dir: Path) -> CheckpointSpec:
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
        persister_timeout=section.persister_timeout,
        replica=None
        if section.replica is None
        else ReplicaSpec(
            every=section.replica.every, max_mb_per_second=section.replica.max_mb_per_second
        ),
    )


def job_spec(resolved: ResolvedConfig, run_id: str, run_dir: Path, preflight_only: bool) -> JobSpec:
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
        master_grace=config.master.grace,
        stop_grace=job.stop_grace,
        log_max_bytes=int(job.logs.max_bytes),
        log_keep=job.logs.keep,
        log_dir=None if job.logs.dir is None else str(worker_log_dir(resolved, run_id, run_dir)),
        console=job.logs.console,
        redirects=job.logs.redirects,
        tee=job.logs.tee,
        local_ranks_filter=job.logs.local_ranks_filter,
        preload=[] if preflight_only else job.preload,
        chaos=config.chaos,
        checkpoint=None if preflight_only else checkpoint_spec(resolved, run_dir),
        diagnosis=agent_spec(resolved, preflight_only),
    )


def job_settings(
    resolved: ResolvedConfig, manager: PluginManager, spec: JobSpec, preflight_only: bool
) -> JobSettings:
    config = resolved.config
    return JobSettings(
        spec=spec,
        min_nodes=config.job.nodes.min,
        max_nodes=config.job.nodes.max,
        node_unit=config.job.node_unit,
        join_grace=config.rendezvous.join_grace,
        join_timeout=config.rendezvous.join_timeout,
        diagnosis=master_policy(resolved, manager, preflight_only),
        standby=0 if preflight_only else config.job.standby,
        placement=rank_placement(resolved),
        store="rank0" if preflight_only else config.rendezvous.store,
    )


def rank_placement(resolved: ResolvedConfig) -> RankPlacement[Any]:
    """The configured rank placement (``rendezvous.backend``); ``stable`` where the section
    was left at its default and resolved to nothing."""
    backend = resolved.backends.get("rendezvous")
    if backend is None:
        return StablePlacement()
    placement: RankPlacement[Any] = backend.record.factory(backend.options)
    return placement
