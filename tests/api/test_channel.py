"""The agents' channel (``GET /v1/channel``, :mod:`planaria.master.channel`) of a live master,
played over real WebSockets: requests answered as over HTTP, the next action pushed the moment
the master decides it, a request sent again after its connection dropped served once, and bad
messages refused with what is wrong."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from planaria.master.channel import KEPT_REPLIES
from support.master import AUTH, with_master

REPORT = {
    "node_id": "node-0",
    "rule": {"kind": "kill_worker", "rank": 0, "at_step": 3},
    "time": 1.0,
}


async def _open(session: aiohttp.ClientSession, url: str, client: str):
    return await session.ws_connect(f"{url}/channel?client={client}", headers=AUTH)


async def _ask(ws, seq: int, op: str, body: dict, waiting: list[int] | None = None) -> None:
    """Send request ``seq``; ``waiting``: the requests whose replies the agent waits for (by
    default this one only: it has every other reply)."""
    message = {"seq": seq, "op": op, "open": [seq] if waiting is None else waiting, "body": body}
    await ws.send_str(json.dumps(message))


async def _reply(ws, timeout: float = 10) -> dict:
    message = await ws.receive(timeout=timeout)
    assert message.type is aiohttp.WSMsgType.TEXT, message
    return json.loads(message.data)


async def _register_and_join(session, url) -> list:
    """Both nodes registered and in round 1 over their channels; their open channels."""
    channels = []
    for i in range(2):
        ws = await _open(session, url, f"agent-{i}")
        reg = {"node_id": f"node-{i}", "host": f"h{i}", "addr": "127.0.0.1", "pid": 1}
        await _ask(ws, 1, "/register", reg)
        assert (await _reply(ws))["status"] == 200
        channels.append(ws)
    for i, ws in enumerate(channels):
        join = {"node_id": f"node-{i}", "addr": "127.0.0.1", "port": 40000 + i}
        await _ask(ws, 2, "/rendezvous/join", join)
    for ws in channels:
        reply = await _reply(ws)
        assert reply["re"] == 2 and reply["body"]["state"] == "ready", reply
    return channels


def test_the_next_action_is_pushed_the_moment_the_master_decides_it(tmp_path):
    async def body(master, session, url):
        ws0, ws1 = await _register_and_join(session, url)
        await _ask(ws0, 3, "/actions", {"node_id": "node-0", "round": 1})
        # Nothing to push yet: a heartbeat on the same channel is answered meanwhile.
        beat = {"node_id": "node-0", "round": 1, "activity": "running", "wait": False}
        await _ask(ws0, 4, "/heartbeat", beat, waiting=[3, 4])
        reply = await _reply(ws0)
        assert reply["re"] == 4 and reply["body"]["action"]["kind"] == "none"
        # Node 1's worker fails: the master restarts the round and pushes it to node 0.
        failure = {
            "local_rank": 0,
            "rank": 2,
            "pid": 1,
            "exitcode": 1,
            "signal": None,
            "time": time.time(),
            "log_tail": "",
            "description": "exit code 1",
        }
        report = {"node_id": "node-1", "round": 1, "succeeded": False, "failure": failure}
        sent = time.monotonic()
        await _ask(ws1, 3, "/workers", report)
        assert (await _reply(ws1))["status"] == 200
        pushed = await _reply(ws0)
        assert time.monotonic() - sent < 1.0
        assert pushed["re"] == 3 and pushed["status"] == 200
        assert pushed["body"]["action"]["kind"] == "restart"
        assert pushed["body"]["action"]["round"] == 2

    asyncio.run(with_master(tmp_path, body))


def test_a_request_held_for_long_does_not_keep_the_replies_after_it(tmp_path):
    """The standing ``/actions`` request stays open for a whole round: the heartbeats answered
    meanwhile are forgotten as the agent confirms them, however many there are."""

    async def body(master, session, url):
        ws0, _ = await _register_and_join(session, url)
        await _ask(ws0, 3, "/actions", {"node_id": "node-0", "round": 1})
        beat = {"node_id": "node-0", "round": 1, "activity": "running", "wait": False}
        for seq in range(4, 4 + 2 * KEPT_REPLIES):
            await _ask(ws0, seq, "/heartbeat", beat, waiting=[3, seq])
            reply = await _reply(ws0)
            assert reply["re"] == seq and reply["status"] == 200, reply
        # The held request is still answered when its action comes.
        master.stop("stopped by the test")
        pushed = await _reply(ws0)
        assert pushed["re"] == 3 and pushed["body"]["action"]["kind"] == "exit"

    asyncio.run(with_master(tmp_path, body))


def test_a_request_sent_again_after_its_connection_dropped_is_served_once(tmp_path):
    async def body(master, session, url):
        await _register_and_join(session, url)

        def chaos_events() -> int:
            return sum(
                1
                for e in master.timeline.events
                if e.kind.value == "fault_detected" and e.data.get("fault") == "chaos"
            )

        first = await _open(session, url, "agent-0")
        await _ask(first, 7, "/chaos", REPORT)
        await first.close()  # gone before its reply could be read
        deadline = time.monotonic() + 10
        while chaos_events() < 1:
            assert time.monotonic() < deadline, "the report was never served"
            await asyncio.sleep(0.02)
        again = await _open(session, url, "agent-0")
        await _ask(again, 7, "/chaos", REPORT)
        reply = await _reply(again)
        assert reply == {"re": 7, "status": 200, "body": {"ok": True}}
        assert chaos_events() == 1  # answered from what was kept, not served twice
        # Once the agent no longer waits for that reply (open), the same number is a new request.
        await _ask(again, 8, "/chaos", REPORT)
        await _reply(again)
        await _ask(again, 7, "/chaos", REPORT)
        await _reply(again)
        assert chaos_events() == 3

    asyncio.run(with_master(tmp_path, body))


def test_an_action_decided_while_the_channel_was_down_reaches_the_next_one(tmp_path):
    async def body(master, session, url):
        ws0, _ = await _register_and_join(session, url)
        await _ask(ws0, 3, "/actions", {"node_id": "node-0", "round": 1})
        await asyncio.sleep(0.1)
        await ws0.close()
        master.stop("stopped by the test")  # every node is told to exit: node 0 has no channel
        await asyncio.sleep(0.2)
        again = await _open(session, url, "agent-0")
        await _ask(again, 3, "/actions", {"node_id": "node-0", "round": 1})
        reply = await _reply(again)
        assert reply["re"] == 3 and reply["body"]["action"]["kind"] == "exit"

    asyncio.run(with_master(tmp_path, body))


def test_a_journal_that_fails_gets_no_reply_an_ok(tmp_path):
    """What a request changed is on disk before it is answered: when the journal cannot be
    written, the reply says so (500), and a request sent again gets the same."""

    async def body(master, session, url):
        def broken() -> asyncio.Future[None]:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(OSError("disk full"))
            return failed

        ws = await _open(session, url, "agent-0")
        master.journal_commit = broken
        try:
            await _ask(ws, 1, "/chaos", REPORT)
            reply = await _reply(ws)
            await _ask(ws, 1, "/chaos", REPORT)
            again = await _reply(ws)
        finally:
            del master.journal_commit
        assert reply["status"] == 500 and "disk full" in reply["body"]["error"], reply
        assert again == reply

    asyncio.run(with_master(tmp_path, body))


def test_bad_messages_are_refused_saying_what_is_wrong(tmp_path):
    async def body(master, session, url):
        ws = await _open(session, url, "agent-x")
        await _ask(ws, 1, "/nowhere", {})
        reply = await _reply(ws)
        assert reply["re"] == 1 and reply["status"] == 404
        assert "no '/nowhere'" in reply["body"]["error"]
        await _ask(ws, 2, "/heartbeat", {"node_id": "node-0", "round": "one"})
        reply = await _reply(ws)
        assert reply["status"] == 400
        assert any(p.startswith("round:") for p in reply["body"]["problems"])
        await _ask(ws, 3, "/heartbeat", {"node_id": "ghost", "round": 0, "activity": "idle"})
        assert (await _reply(ws))["status"] == 404
        # Not a request at all: said, and the channel is closed.
        await ws.send_str("[1, 2]")
        reply = await _reply(ws)
        assert reply["re"] is None and reply["status"] == 400
        assert "JSON object" in reply["body"]["error"]
        closed = await ws.receive(timeout=5)
        assert closed.type is aiohttp.WSMsgType.CLOSE and closed.data == 1008
        # Without the token, a client id or an upgrade, there is no channel; the refusal is
        # the API's (JSON, saying what is wrong).
        upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}
        for headers, query, status, said in (
            (upgrade, "?client=a", 401, "token"),
            ({**AUTH, **upgrade}, "", 400, "client=ID"),
            (AUTH, "?client=a", 400, "GET /v1/channel"),
        ):
            async with session.get(f"{url}/channel{query}", headers=headers) as r:
                assert r.status == status, await r.text()
                assert said in (await r.json())["error"]
        async with session.post(f"{url}/channel?client=a", headers=AUTH) as r:
            assert r.status == 405 and r.headers["Allow"] == "GET,HEAD", await r.text()
            assert "POST /v1/channel" in (await r.json())["error"]

    asyncio.run(with_master(tmp_path, body))


def test_a_notice_is_taken_without_a_reply_and_refused_with_one(tmp_path):
    """A heartbeat sent as a notice (no ``seq``) tells the master of the node's progress and
    gets nothing back; a notice it cannot take is refused with what is wrong, the channel
    left open; one for a fenced node is not answered (its standing ``/actions`` says it)."""

    async def body(master, session, url):
        ws0, _ = await _register_and_join(session, url)

        async def notice(op: str, data: dict) -> None:
            await ws0.send_str(json.dumps({"op": op, "body": data}))

        beat = {
            "node_id": "node-0",
            "round": 1,
            "activity": "running",
            "wait": False,
            "progress": [{"local_rank": 0, "step": 7, "time": time.time(), "step_s": 0.1}],
        }
        await notice("/heartbeat", beat)
        deadline = time.monotonic() + 10
        while master.nodes["node-0"].step != 7:
            assert time.monotonic() < deadline, "the notice was not taken"
            await asyncio.sleep(0.02)
        # Bad ones, each told (re null, the op named), the channel still open.
        await notice("/heartbeat", {**beat, "round": "one"})
        reply = await _reply(ws0)
        assert reply["re"] is None and reply["op"] == "/heartbeat" and reply["status"] == 400
        assert any(p.startswith("round:") for p in reply["body"]["problems"]), reply
        await notice("/workers", {"node_id": "node-0"})
        reply = await _reply(ws0)
        assert reply["status"] == 404 and "send it with a seq" in reply["body"]["error"]
        await notice("/heartbeat", {**beat, "node_id": "ghost"})
        assert (await _reply(ws0))["status"] == 404
        assert master.channel.notices_refused == 3
        # Nothing came back for the good one: the next message is this request's reply.
        await _ask(ws0, 3, "/heartbeat", beat)
        reply = await _reply(ws0)
        assert reply["re"] == 3 and reply["status"] == 200, reply
        # Node 0 fenced out: its notices get no reply, its standing /actions gets the 410.
        master.recovery.node_lost(master.nodes["node-0"], "lost by the test")
        await notice("/heartbeat", beat)
        await _ask(ws0, 4, "/actions", {"node_id": "node-0", "round": 1})
        reply = await _reply(ws0)
        assert reply["re"] == 4 and reply["status"] == 410, reply

    asyncio.run(with_master(tmp_path, body))
