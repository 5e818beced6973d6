"""A live master in this process, its HTTP API served on loopback, for tests that play the
agents over HTTP."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from planaria.master.job import Master
from planaria.master.runner import supervise
from planaria.master.server import ServerLimits, make_app, serve
from planaria.master.state import JobSettings
from planaria.protocol import API_PREFIX, CheckpointSpec, JobSpec
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler

TOKEN = "s3cret-token"


def settings(
    tmp_path: Path,
    nodes: int = 2,
    heartbeat_timeout: float = 30,
    standby: int = 0,
    max_restarts: int = 1,
    checkpoint: CheckpointSpec | None = None,
) -> JobSettings:
    spec = JobSpec(
        job="api",
        run_id="api-1",
        run_dir=str(tmp_path),
        command=["true"],
        workdir=str(tmp_path),
        env={},
        procs_per_node=2,
        max_restarts=max_restarts,
        checkpoint=checkpoint,
        heartbeat_interval=0.5,
        heartbeat_timeout=heartbeat_timeout,
        stop_grace=1,
        preload=[],
    )
    return JobSettings(
        spec=spec,
        min_nodes=nodes,
        max_nodes=nodes,
        node_unit=1,
        join_grace=5,
        join_timeout=60,
        standby=standby,
    )


async def with_master(
    tmp_path: Path,
    body,
    limits: ServerLimits | None = None,
    *,
    heartbeat_timeout: float = 30,
    join_hold: float = 5.0,
    hold: float = 0.2,
    standby: int = 0,
    **job: Any,
) -> None:
    """A master whose nodes never call back: ``body(master, session, url)`` plays the agents;
    ``job``: more of :func:`settings`' arguments."""
    job_settings = settings(tmp_path, heartbeat_timeout=heartbeat_timeout, standby=standby, **job)
    master = Master(job_settings, LocalScheduler(LocalOptions()), tmp_path)
    app = make_app(master, TOKEN, hold=hold, limits=limits, join_hold=join_hold)
    runner, port = await serve(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}{API_PREFIX}"
    # Stand-in agents that never call back: the test plays the agents over HTTP.
    idle = LaunchSpec(job="api", command=(sys.executable, "-c", "import time; time.sleep(60)"))
    job = asyncio.ensure_future(supervise(master, idle))
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30  # launched (slow on a busy machine)
            while len(master.nodes) < job_settings.min_nodes + standby:
                assert time.monotonic() < deadline, "the job's nodes were never launched"
                await asyncio.sleep(0.02)
            await body(master, session, url)
    finally:
        master.stop("test over")
        await asyncio.wait_for(job, 30)
        await runner.cleanup()
        master.timeline.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def post(session: aiohttp.ClientSession, url: str, path: str, data: dict) -> Any:
    """Play an agent's call to the master: ``data`` to ``path``, its JSON answer (which must
    be a 200)."""
    async with session.post(url + path, json=data, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return await r.json()
