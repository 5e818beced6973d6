"""The master's diagnosis endpoints (``/v1/hang``, ``/v1/health``) over real HTTP."""

from __future__ import annotations

import asyncio
import time

from support.master import AUTH, with_master


def hang_report(node: str, round_: int) -> dict:
    rank = {
        "rank": 0,
        "local_rank": 0,
        "pid": 1,
        "step": 7,
        "stalled_s": 5.0,
        "state": "T (stopped)",
        "stack": "Thread 1 (idle)\n    train (train.py:3)",
    }
    return {"node_id": node, "round": round_, "timeout": 5, "ranks": [rank], "time": time.time()}


def test_bad_reports_are_400_naming_the_field_and_unknown_nodes_404(tmp_path):
    async def body(master, session, url):
        bad = hang_report("node-0", 1)
        del bad["ranks"]
        async with session.post(url + "/hang", json=bad, headers=AUTH) as r:
            assert r.status == 400
            assert "ranks: Field required" in (await r.json())["problems"]
        async with session.post(url + "/hang", json=hang_report("ghost", 1), headers=AUTH) as r:
            assert r.status == 404
        health = {"node_id": "node-0", "host": "h", "failures": [{"check": "x"}], "time": 1.0}
        async with session.post(url + "/health", json=health, headers=AUTH) as r:
            assert r.status == 400
            problems = (await r.json())["problems"]
            assert "failures.0.status: Field required" in problems
        assert master.restarts == 0

    asyncio.run(with_master(tmp_path, body))


def test_a_hang_outside_the_running_round_is_kept_but_restarts_nothing(tmp_path):
    async def body(master, session, url):
        async with session.post(url + "/hang", json=hang_report("node-0", 1), headers=AUTH) as r:
            assert r.status == 200
        (event,) = [e for e in master.timeline.events if e.kind.value == "hang_detected"]
        assert event.data["secondary"] and event.data["ranks"][0]["state"] == "T (stopped)"
        assert master.restarts == 0 and master.faults == []

    asyncio.run(with_master(tmp_path, body))


def test_an_unhealthy_node_is_excluded_and_replaced(tmp_path):
    async def body(master, session, url):
        host = master.nodes["node-1"].host
        failure = {"check": "chip", "status": "failed", "detail": "chip0: failed ECC"}
        report = {"node_id": "node-1", "host": host, "failures": [failure], "time": time.time()}
        async with session.post(url + "/health", json=report, headers=AUTH) as r:
            assert r.status == 200
        assert master.nodes["node-1"].phase.value == "lost"
        for _ in range(100):
            if any(e.kind.value == "node_replaced" for e in master.timeline.events):
                break
            await asyncio.sleep(0.05)
        kinds = [e.kind.value for e in master.timeline.events]
        assert {"health_checked", "node_excluded", "node_replaced"} <= set(kinds)
        assert master.scheduler.excluded_hosts() == {host}
        (fault,) = master.faults
        assert (fault.kind, fault.fault_class) == ("unhealthy", "node")
        assert "chip: chip0: failed ECC" in fault.reason

    asyncio.run(with_master(tmp_path, body))
