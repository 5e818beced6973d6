"""The master's HTTP API, driven by a real HTTP client standing in for agents."""

from __future__ import annotations

import asyncio
import time

import pytest

from planaria.master import job as job_module
from planaria.master import recovery
from planaria.master.runner import join_hold
from planaria.master.state import JobState
from planaria.protocol import CheckpointSpec, ReplicaSpec
from support.master import AUTH, TOKEN, post, with_master


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


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["capped", "5s"])
def test_a_node_waiting_in_a_join_is_not_silent(tmp_path, hold):
    """One of two nodes joins and waits for the other, asking again whenever its join comes
    back "wait". With the join held at most half the heartbeat timeout (as ``planaria run``
    holds it) it is never taken for lost; held 5 s against a 1.5 s timeout, it was."""
    timeout = 1.5

    async def body(master, session, url):
        for i in range(2):
            reg = {"node_id": f"node-{i}", "host": f"h{i}", "addr": "127.0.0.1", "pid": 1}
            async with session.post(url + "/register", json=reg, headers=AUTH) as r:
                assert r.status == 200
        deadline = time.monotonic() + 4 * timeout

        async def beat() -> None:  # the other node is heard all along: no master cut off
            while time.monotonic() < deadline:
                b = {"node_id": "node-1", "round": 0, "activity": "idle", "wait": False}
                async with session.post(url + "/heartbeat", json=b, headers=AUTH) as r:
                    assert r.status == 200
                await asyncio.sleep(0.2)

        beating = asyncio.ensure_future(beat())
        join = {"node_id": "node-0", "addr": "127.0.0.1", "port": 40000}
        while time.monotonic() < deadline:
            async with session.post(url + "/rendezvous/join", json=join, headers=AUTH) as r:
                if r.status != 200 or (await r.json())["state"] != "wait":
                    break
        await beating
        lost = master.nodes["node-0"].phase.value == "lost"
        assert lost == (hold == "5s"), master.nodes["node-0"].phase

    held = join_hold(timeout) if hold == "capped" else 5.0
    asyncio.run(with_master(tmp_path, body, heartbeat_timeout=timeout, join_hold=held))


MISSING = "ModuleNotFoundError: No module named 'no_such_module_xyz'"
TRACEBACK = f'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n{MISSING}'


@pytest.mark.parametrize("rank_0_stepped", [False, True])
def test_a_crash_loop_counts_late_reports_and_not_rounds_that_stepped(tmp_path, rank_0_stepped):
    """Two nodes whose workers fail on import: the second node's report of round 1 comes after
    the restart, and still counts, so round 2's first report stops the job (with one restart
    left). A round whose rank 0 completed a step is no crash loop's, even when another node's
    workers did not step."""

    async def body(master, session, url):
        for i in range(2):
            reg = {"node_id": f"node-{i}", "host": f"local-{i}", "addr": "127.0.0.1", "pid": 1}
            await post(session, url, "/register", reg)

        async def form_round() -> dict[int, str]:
            async def join(i: int) -> dict:
                req = {"node_id": f"node-{i}", "addr": "127.0.0.1", "port": 40000 + i}
                return await post(session, url, "/rendezvous/join", req)

            replies = await asyncio.gather(join(0), join(1))
            assert [r["state"] for r in replies] == ["ready", "ready"]
            return {r["info"]["node_rank"]: f"node-{i}" for i, r in enumerate(replies)}

        def failed(node: str, round_: int, rank: int) -> dict:
            failure = {
                "local_rank": rank % 2, "rank": rank, "pid": 1, "exitcode": 1, "signal": None,
                "time": time.time(), "log_tail": TRACEBACK, "description": "exit code 1",
            }  # fmt: skip
            return {"node_id": node, "round": round_, "succeeded": False, "failure": failure}

        nodes = await form_round()
        await post(session, url, "/workers", failed(nodes[1], 1, 2))
        assert master.round == 2 and master.restarts == 1
        await post(session, url, "/workers", failed(nodes[0], 1, 0))  # late: round 2 is forming
        assert master.restarts == 1 and not master.stopping
        assert await form_round() == nodes
        if rank_0_stepped:
            now = time.time()
            progress = [{"local_rank": 0, "step": 0, "time": now, "first_step": 0}]
            beat = {"node_id": nodes[0], "round": 2, "activity": "running", "wait": False,
                    "progress": progress, "first_step_time": now}  # fmt: skip
            await post(session, url, "/heartbeat", beat)
            await post(session, url, "/workers", failed(nodes[1], 2, 2))
            assert master.stopping
            assert master.reason.startswith("restart budget spent (1 of 1 restarts used)")
        else:
            await post(session, url, "/workers", failed(nodes[0], 2, 0))
            assert master.stopping
            assert master.reason.startswith(f"crash loop: rank 0 failed with {MISSING!r} twice")
        stopped = [e for e in master.timeline.events if e.kind.value == "job_stopped"]
        cause = "restart_budget_spent" if rank_0_stepped else "crash_loop"
        assert [e.data["cause"] for e in stopped] == [cause]

    asyncio.run(with_master(tmp_path, body))


@pytest.mark.parametrize("big", [True, False])
def test_a_big_jobs_first_progress_samples_of_a_round_are_spread(tmp_path, monkeypatch, big):
    """Beyond ``PROGRESS_NODES`` nodes a node's first progress event of a round comes at a
    random time within the (longer) interval, not at its first step: every node starting a
    round would write one at once. A small job writes one at each node's first step."""
    monkeypatch.setattr(job_module, "PROGRESS_NODES", 1 if big else 64)
    monkeypatch.setattr(job_module.random, "random", lambda: 0.25)

    async def body(master, session, url):
        assert [r["state"] for r in await _two_nodes_joined(session, url)] == ["ready"] * 2
        for node in master.nodes.values():
            behind = time.monotonic() - node.sampled
            if big:  # a quarter of 5 s x 2 nodes / 1 into the interval
                assert 2.5 <= behind < 3.0, behind
            else:
                assert behind == float("inf")
        for i in range(2):
            progress = [{"local_rank": 0, "step": 3, "time": time.time(), "first_step": 1}]
            beat = {"node_id": f"node-{i}", "round": 1, "activity": "running", "wait": False,
                    "progress": progress}  # fmt: skip
            async with session.post(url + "/heartbeat", json=beat, headers=AUTH) as r:
                assert r.status == 200
        sampled = [e.node for e in master.timeline.events if e.kind.value == "progress"]
        assert sampled == ([] if big else ["node-0", "node-1"])

    asyncio.run(with_master(tmp_path, body))


@pytest.mark.parametrize("big", [True, False])
def test_the_first_long_poll_of_a_round_is_held_for_part_of_the_interval_in_a_big_job(
    tmp_path, monkeypatch, big
):
    """In a job of ``SPREAD_NODES`` nodes or more, a node's first heartbeat long poll of a
    round comes back after a random part of the hold (here a quarter), its next ones after
    all of it: the nodes' polls spread over the interval instead of coming as one wave. A
    smaller job holds every poll the whole interval."""
    monkeypatch.setattr(job_module, "SPREAD_NODES", 0 if big else 2)
    monkeypatch.setattr(job_module.random, "random", lambda: 0.25)

    async def body(master, session, url):
        reg = {"node_id": "node-0", "host": "h", "addr": "127.0.0.1", "pid": 1}
        async with session.post(url + "/register", json=reg, headers=AUTH) as r:
            assert r.status == 200
        took = []
        for round_ in (1, 1, 2, 2):
            beat = {"node_id": "node-0", "round": round_, "activity": "running", "wait": True}
            started = time.monotonic()
            async with session.post(url + "/heartbeat", json=beat, headers=AUTH) as r:
                assert r.status == 200
                assert (await r.json())["action"]["kind"] == "none"
            took.append(time.monotonic() - started)
        first, second, first_of_2, second_of_2 = took
        # A 1 s hold: a quarter of it (0.25 s) and the whole stay apart on a busy machine.
        assert second >= 0.95 and second_of_2 >= 0.95, took
        if big:
            assert first < 0.7 and first_of_2 < 0.7, took
        else:
            assert first >= 0.95 and first_of_2 >= 0.95, took

    asyncio.run(with_master(tmp_path, body, hold=1.0))


async def _two_nodes_joined(session, url) -> list[dict]:
    """Register node-0 and node-1 and have both join the first round: their join replies."""
    for i in range(2):
        reg = {"node_id": f"node-{i}", "host": f"h{i}", "addr": "127.0.0.1", "pid": 1}
        async with session.post(url + "/register", json=reg, headers=AUTH) as r:
            assert r.status == 200

    async def join(i: int) -> dict:
        req = {"node_id": f"node-{i}", "addr": "127.0.0.1", "port": 40000 + i}
        async with session.post(url + "/rendezvous/join", json=req, headers=AUTH) as r:
            return await r.json()

    return list(await asyncio.gather(join(0), join(1)))


@pytest.mark.parametrize("first", [0, 1])
def test_steps_done_counts_from_the_first_step_the_workers_reported(tmp_path, first):
    """A script that numbers its 80 steps 1..80 did 80 steps, as one that numbers them 0..79:
    the count starts at the first step its workers reported, not at 0."""

    async def body(master, session, url):
        replies = await _two_nodes_joined(session, url)
        leader = next(f"node-{i}" for i, r in enumerate(replies) if r["info"]["node_rank"] == 0)
        for step in (first + 4, first + 79):  # the agent looks late: its first look is step 4
            progress = [{"local_rank": 0, "step": step, "time": time.time(), "first_step": first}]
            beat = {"node_id": leader, "round": 1, "activity": "running", "wait": False,
                    "progress": progress, "first_step_time": time.time()}  # fmt: skip
            async with session.post(url + "/heartbeat", json=beat, headers=AUTH) as r:
                assert r.status == 200
        assert master.summary().steps == 80

    asyncio.run(with_master(tmp_path, body))


def test_rank_0s_loss_is_sampled_at_each_heartbeat_that_brings_a_new_one(tmp_path):
    """The job's loss series is rank 0's: a heartbeat of the node holding rank 0 with a new
    loss is a progress event with it, whatever the interval between step samples; the same
    loss again, or another node's, is none. ``/metrics`` serves the last one."""
    from planaria.master.metrics import StateNow

    async def body(master, session, url):
        replies = await _two_nodes_joined(session, url)
        rank = {f"node-{i}": r["info"]["rank_offset"] for i, r in enumerate(replies)}
        leader, other = sorted(rank, key=rank.__getitem__)
        assert not [m for m in StateNow(master).collect() if m.name == "planaria_loss"]

        async def beat(node: str, step: int, loss: float | None, loss_step: int) -> None:
            progress = [
                {"local_rank": 0, "step": step, "time": time.time(), "first_step": 0,
                 "loss": loss, "loss_step": loss_step},
                {"local_rank": 1, "step": step, "time": time.time(), "first_step": 0,
                 "loss": 99.0, "loss_step": step},  # not rank 0's
            ]  # fmt: skip
            body = {"node_id": node, "round": 1, "activity": "running", "wait": False,
                    "progress": progress}  # fmt: skip
            await post(session, url, "/heartbeat", body)

        await beat(leader, 3, 2.5, 2)
        await beat(other, 3, 7.0, 3)
        await beat(leader, 4, 2.5, 2)  # the same loss: no news
        await beat(leader, 6, 2.25, 6)
        await beat(leader, 7, None, -1)
        samples = [
            (e.node, e.step, e.data.get("loss"), e.data.get("loss_step"))
            for e in master.timeline.events
            if e.kind.value == "progress"
        ]
        assert samples == [
            (leader, 3, 2.5, 2),
            (other, 3, None, None),  # its first step of the round
            (leader, 6, 2.25, 6),
        ]
        (gauge,) = [m for m in StateNow(master).collect() if m.name == "planaria_loss"]
        assert [s.value for s in gauge.samples] == [2.25]

    asyncio.run(with_master(tmp_path, body))


def test_rank_0s_tokens_are_counted_into_the_timeline_and_served_as_a_counter(
    tmp_path, monkeypatch
):
    """Each heartbeat of the node holding rank 0 brings its worker's sum of tokens: the job
    counts what each adds, puts the count in that node's step samples (with the round's own
    sum, which a resumed master counts on from) and serves it as ``planaria_tokens_total``;
    another node's or another local rank's sum counts for nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    from planaria.master.metrics import JobMetrics
    from planaria.master.timeline import last_tokens

    monkeypatch.setattr(job_module, "PROGRESS_EVERY", 0.0)  # every heartbeat a sample

    async def body(master, session, url):
        replies = await _two_nodes_joined(session, url)
        rank = {f"node-{i}": r["info"]["rank_offset"] for i, r in enumerate(replies)}
        leader, other = sorted(rank, key=rank.__getitem__)
        metrics = JobMetrics(master)

        def served() -> dict[str, float]:
            text = metrics.exposition().root
            return {
                s.name: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name.startswith("planaria_tokens")
            }

        assert served() == {}  # no made-up zero before the training reports any

        async def beat(node: str, step: int, tokens: float | None) -> None:
            progress = [
                {"local_rank": 0, "step": step, "time": time.time(), "first_step": 0,
                 "tokens": tokens, "tokens_step": -1 if tokens is None else step},
                {"local_rank": 1, "step": step, "time": time.time(), "first_step": 0,
                 "tokens": 1e9, "tokens_step": step},  # not rank 0's
            ]  # fmt: skip
            body = {"node_id": node, "round": 1, "activity": "running", "wait": False,
                    "progress": progress}  # fmt: skip
            await post(session, url, "/heartbeat", body)

        await beat(leader, 3, 4 * 1024.0)
        await beat(other, 3, 8 * 1024.0)
        await beat(leader, 5, 6 * 1024.0)
        await beat(leader, 6, None)  # a heartbeat without tokens: the count stays
        samples = [
            (e.node, e.step, e.data.get("tokens"), e.data.get("round_tokens"))
            for e in master.timeline.events
            if e.kind.value == "progress"
        ]
        assert samples == [
            (leader, 3, 4096.0, 4096.0),
            (other, 3, None, None),
            (leader, 5, 6144.0, 6144.0),
            (leader, 6, 6144.0, 6144.0),
        ]
        assert served() == {"planaria_tokens_total": 6144.0}
        assert master.summary().tokens == 6144.0
        # A master resumed on this timeline counts on from its last sample.
        resumed = last_tokens(master.timeline.path)
        assert (resumed.total, resumed.round, resumed.seen) == (6144.0, 1, 6144.0)
        resumed.heard(1, 7 * 1024.0)
        assert resumed.total == 7 * 1024.0

    asyncio.run(with_master(tmp_path, body))


def test_a_node_standing_by_is_held_until_the_next_round_opens_and_then_joins_it(tmp_path):
    """``job.standby``: a node beyond the full world is told to stand by, its join held until
    a round opens (a lost node's place) rather than polled again later; it then joins that
    round, which closes at once with it and the survivor."""

    async def body(master, session, url):
        assert len(master.nodes) == 3  # the world's 2 and the one standing by
        replies = await _two_nodes_joined(session, url)
        assert all(r["state"] == "ready" for r in replies)
        reg = {"node_id": "node-2", "host": "h2", "addr": "127.0.0.1", "pid": 1}
        async with session.post(url + "/register", json=reg, headers=AUTH) as r:
            assert r.status == 200
        req = {"node_id": "node-2", "addr": "127.0.0.1", "port": 40002}

        async def join() -> tuple[dict, float]:
            started = time.monotonic()
            async with session.post(url + "/rendezvous/join", json=req, headers=AUTH) as r:
                return await r.json(), time.monotonic() - started

        standing, _ = await join()
        assert standing["state"] == "wait" and "standing by" in standing["reason"]
        held = asyncio.ensure_future(join())
        await asyncio.sleep(1.5)  # the join hold is 5 s: still held
        assert not held.done()
        lost = master.nodes["node-1"]
        master.recovery.node_lost(lost, "test: gone")
        # The survivor restarts; the node standing by is not told to (it would stop the
        # workers it is about to start in the new round).
        assert master.nodes["node-0"].action.kind == "restart"
        assert master.nodes["node-2"].action is None
        reply, took = await asyncio.wait_for(held, 10)
        assert reply["state"] == "wait" and took < 4.5, (reply, took)

        async def survivor() -> dict:  # what node-0 does on its restart action
            req0 = {"node_id": "node-0", "addr": "127.0.0.1", "port": 40000}
            async with session.post(url + "/rendezvous/join", json=req0, headers=AUTH) as r:
                return await r.json()

        (ready, _), rejoined = await asyncio.gather(join(), survivor())
        assert ready["state"] == "ready" and rejoined["state"] == "ready", (ready, rejoined)
        assert ready["info"]["node_rank"] == replies[1]["info"]["node_rank"]
        formed = [e for e in master.timeline.events if e.kind.value == "rendezvous_completed"]
        assert [e.data.get("from_standby") for e in formed] == [None, ["node-2"]]

        # The lost node's replacement only refills the pool: it is not started while the
        # job recovers (it would compete with the recovering workers), but once the new round
        # completed its first step.
        await asyncio.sleep(1.0)
        assert sorted(master.nodes) == ["node-0", "node-1", "node-2"]
        leader, info = next(
            (n, r["info"]) for n, r in (("node-2", ready), ("node-0", rejoined))
            if r["info"]["node_rank"] == 0
        )  # fmt: skip
        progress = [{"local_rank": 0, "step": 7, "time": time.time(), "first_step": 7}]
        beat = {"node_id": leader, "round": info["round"], "activity": "running", "wait": False,
                "progress": progress, "first_step_time": time.time()}  # fmt: skip
        asked = time.monotonic()
        await post(session, url, "/heartbeat", beat)
        while len(master.nodes) < 4:
            assert time.monotonic() - asked < recovery.REFILL_WAIT / 2, "no refill"
            await asyncio.sleep(0.02)

    asyncio.run(with_master(tmp_path, body, standby=1))


def test_a_replica_is_planned_for_a_node_that_lost_its_memory_and_not_again_once_it_failed(
    tmp_path,
):
    """Two nodes of two ranks with peer replicas: each round names each node's buddy (the
    other). A round after node-1 lost its memory plans memory, node-1 fetching ranks 2 and 3
    from the replica node-0 keeps; node-1's report that the fetch failed restarts the round, and
    the next plans storage (that replica is not planned from again)."""
    replica = CheckpointSpec(storage={"backend": "local"}, replica=ReplicaSpec())

    async def body(master, session, url):
        for i in range(2):
            reg = {"node_id": f"node-{i}", "host": f"local-{i}", "addr": f"10.0.0.{i}", "pid": 1}
            await post(session, url, "/register", reg)

        def holding(local_rank: int, rank: int) -> dict:
            return {"local_rank": local_rank, "rank": rank, "world": 4, "steps": [6, 5]}

        async def form_round(memory: bool) -> dict[str, dict]:
            def request(i: int) -> dict:
                own = [holding(0, 2 * i), holding(1, 2 * i + 1)] if memory or i == 0 else []
                other = 1 - i
                kept = [{"rank": 2 * other + k, "world": 4, "steps": [5], "source": f"node-{other}"}
                        for k in range(2)]  # fmt: skip
                return {"node_id": f"node-{i}", "addr": f"10.0.0.{i}", "port": 40000 + i,
                        "memory": own, "replica_port": 41000 + i, "replicas": kept}  # fmt: skip

            replies = await asyncio.gather(
                *(post(session, url, "/rendezvous/join", request(i)) for i in range(2))
            )
            assert [r["state"] for r in replies] == ["ready", "ready"]
            return {f"node-{i}": r for i, r in enumerate(replies)}

        def failed(round_: int, fetch: dict | None) -> dict:
            failure = {
                "local_rank": 0, "rank": 2, "pid": 1, "exitcode": 1, "signal": None,
                "time": time.time(), "log_tail": "", "description": "failed",
                "replica_error": fetch,
            }  # fmt: skip
            return {"node_id": "node-1", "round": round_, "succeeded": False, "failure": failure}

        first = await form_round(memory=True)
        assert first["node-0"]["directives"]["replica_to"] == {
            "node_id": "node-1", "addr": "10.0.0.1", "port": 41001
        }  # fmt: skip
        assert first["node-1"]["directives"]["replica_to"]["node_id"] == "node-0"
        assert first["node-0"]["directives"]["restore"] == "memory:6"  # its own memory
        assert first["node-1"]["directives"]["fetch"] == []

        await post(session, url, "/workers", failed(1, None))
        second = await form_round(memory=False)  # node-1's memory is gone
        directives = second["node-1"]["directives"]
        assert directives["restore"] == "memory:5"
        holder = {"node_id": "node-0", "addr": "10.0.0.0", "port": 41000}
        assert directives["fetch"] == [
            {"local_rank": k, "rank": 2 + k, "world": 4, "step": 5, "holder": holder}
            for k in range(2)
        ]
        assert second["node-0"]["directives"]["fetch"] == []

        await post(session, url, "/workers", failed(2, directives["fetch"][0]))
        third = await form_round(memory=False)
        assert third["node-1"]["directives"]["restore"] == "storage"
        assert third["node-1"]["directives"]["fetch"] == []
        rounds = [e for e in master.timeline.events if e.kind.value == "rendezvous_completed"]
        assert rounds[-1].data["restore_why"] == "rank 2 (node-1) holds no step in memory"
        assert (
            rounds[-2]
            .data["restore_why"]
            .endswith("(rank 2 from node-0, rank 3 from node-0: replicas)")
        )

    asyncio.run(with_master(tmp_path, body, max_restarts=3, checkpoint=replica))
