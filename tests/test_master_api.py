"""The master's HTTP API, driven by a real HTTP client standing in for agents."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp

from planaria.master.job import Master
from planaria.master.runner import supervise
from planaria.master.server import ServerLimits, make_app, serve
from planaria.master.state import JobSettings, JobState
from planaria.protocol import API_PREFIX, JobSpec
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler

TOKEN = "s3cret-token"


def settings(tmp_path: Path, nodes: int = 2) -> JobSettings:
    spec = JobSpec(
        job="api",
        run_id="api-1",
        run_dir=str(tmp_path),
        command=["true"],
        workdir=str(tmp_path),
        env={},
        procs_per_node=2,
        max_restarts=1,
        heartbeat_interval=0.5,
        heartbeat_timeout=30,
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
    )


async def with_master(tmp_path: Path, body, limits: ServerLimits | None = None) -> None:
    """A master whose nodes never call back: ``body(master, session, url)`` plays the agents."""
    master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
    app = make_app(master, TOKEN, hold=0.2, limits=limits)
    runner, port = await serve(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}{API_PREFIX}"
    # Stand-in agents that never call back: the test plays the agents over HTTP.
    idle = LaunchSpec(job="api", command=(sys.executable, "-c", "import time; time.sleep(60)"))
    job = asyncio.ensure_future(supervise(master, idle))
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(0.2)  # launched
            await body(master, session, url)
    finally:
        master.stop("test over")
        await asyncio.wait_for(job, 30)
        await runner.cleanup()
        master.timeline.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_bad_token_is_401_and_changes_nothing(tmp_path):
    async def body(master, session, url):
        before = master.status()
        register = {"node_id": "node-0", "host": "h", "addr": "127.0.0.1", "pid": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path, data in (
                ("POST", "/register", register),
                ("POST", "/rendezvous/join", {"node_id": "node-0", "addr": "a", "port": 1}),
                ("POST", "/workers", {"node_id": "node-0", "round": 1, "succeeded": True}),
                ("GET", "/status", None),
            ):
                async with session.request(method, url + path, json=data, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    assert "token" in (await r.json())["error"]
        assert master.status() == before
        assert all(n.phase.value == "launched" for n in master.nodes.values())

    asyncio.run(with_master(tmp_path, body))


def test_bad_request_is_400_naming_the_field_and_unknown_node_404(tmp_path):
    async def body(master, session, url):
        bad = {"node_id": "node-0", "addr": "a", "port": 99999}
        async with session.post(url + "/rendezvous/join", json=bad, headers=AUTH) as r:
            assert r.status == 400
            reply = await r.json()
            assert reply["error"] == "invalid JoinRequest"
            assert any(p.startswith("port:") for p in reply["problems"])
        async with session.post(url + "/register", data=b"{not json", headers=AUTH) as r:
            assert r.status == 400
        reg = {"node_id": "node-0", "host": "h", "addr": "127.0.0.1", "pid": 1}
        async with session.post(url + "/register", json=reg, headers=AUTH) as r:
            assert r.status == 200
        nonsense = {"node_id": "node-0", "round": 1, "succeeded": False}
        async with session.post(url + "/workers", json=nonsense, headers=AUTH) as r:
            assert r.status == 400
            assert "must name the failure" in (await r.json())["error"]
        beat = {"node_id": "ghost", "round": 1, "activity": "idle"}
        async with session.post(url + "/heartbeat", json=beat, headers=AUTH) as r:
            assert r.status == 404
            assert "ghost" in (await r.json())["error"]
        assert master.state is JobState.RENDEZVOUS

    asyncio.run(with_master(tmp_path, body))


def test_two_agents_form_a_round_over_http(tmp_path):
    async def body(master, session, url):
        for i in range(2):
            reg = {"node_id": f"node-{i}", "host": f"local-{i}", "addr": "127.0.0.1", "pid": 1}
            async with session.post(url + "/register", json=reg, headers=AUTH) as r:
                assert r.status == 200
                assert (await r.json())["spec"]["procs_per_node"] == 2

        async def join(i: int) -> dict:
            req = {"node_id": f"node-{i}", "addr": "127.0.0.1", "port": 40000 + i}
            async with session.post(url + "/rendezvous/join", json=req, headers=AUTH) as r:
                return await r.json()

        replies = await asyncio.gather(join(0), join(1))
        assert [r["state"] for r in replies] == ["ready", "ready"]
        infos = {r["info"]["node_rank"]: r["info"] for r in replies}
        assert sorted(infos) == [0, 1]
        assert {i["master_port"] for i in infos.values()} == {40000}
        assert infos[1]["rank_offset"] == 2 and infos[1]["world_size"] == 4
        async with session.get(url + "/status", headers=AUTH) as r:
            status = await r.json()
        assert status["state"] == "running" and status["round"] == 1

    asyncio.run(with_master(tmp_path, body))
