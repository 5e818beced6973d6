"""The agent's client of the master, against a master's channel played here: while the master
answers "not yet" (503, its node's launch in flight), it keeps asking, past the time it would give
an unreachable master, as long as a launch may take (a scheduler that returns once every node
runs keeps early agents waiting). Each try it answered is a new request; a try the channel lost
is sent again under its own sequence number."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from aiohttp import WSMsgType, web
from pydantic import BaseModel

from planaria.agent import client as agent_client
from planaria.agent.client import MasterClient, MasterUnreachable
from planaria.protocol import API_PREFIX


class Answer(BaseModel):
    ok: bool


class Ask(BaseModel):
    node_id: str


async def _serve(not_yet_for: float, drop_first: bool = False):
    """A channel that answers "not yet" for ``not_yet_for`` seconds, then ``{"ok": true}``;
    with ``drop_first`` it closes the connection on the first request, unanswered."""
    started = time.monotonic()
    seen: list[tuple[int, int]] = []  # (seq, status) of each request

    async def channel(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            assert message.type is WSMsgType.TEXT
            asked = json.loads(message.data)
            if "seq" not in asked:  # a notice: refused, as a master refuses a bad one
                seen.append((-1, 400))
                body = {"error": f"{asked['op']} refused", "problems": ["round: not an int"]}
                refusal = {"re": None, "op": asked["op"], "status": 400, "body": body}
                await ws.send_str(json.dumps(refusal))
                continue
            if drop_first and not seen:
                seen.append((asked["seq"], 0))
                await ws.close()
                break
            if time.monotonic() - started < not_yet_for:
                seen.append((asked["seq"], 503))
                body = {"error": "not known yet; ask again", "retry": True}
                await ws.send_str(json.dumps({"re": asked["seq"], "status": 503, "body": body}))
            else:
                seen.append((asked["seq"], 200))
                reply = {"re": asked["seq"], "status": 200, "body": {"ok": True}}
                await ws.send_str(json.dumps(reply))
        return ws

    app = web.Application()
    app.router.add_get(f"{API_PREFIX}/channel", channel)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.SockSite(runner, _bound())
    await site.start()
    return runner, site.name.rsplit(":", 1)[1], seen


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_not_yet_is_waited_out_past_the_unreachable_grace() -> None:
    async def body() -> None:
        runner, port, seen = await _serve(not_yet_for=1.5)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=0.3)
        try:
            answer = await client.call("/status", Ask(node_id="n"), Answer)
        finally:
            await client.close()
            await runner.cleanup()
        assert answer.ok
        statuses = [status for _, status in seen]
        assert statuses.count(503) >= 2 and statuses[-1] == 200
        # Each answered try is a request of its own.
        assert len({seq for seq, _ in seen}) == len(seen)

    asyncio.run(body())


def test_a_try_the_channel_lost_is_sent_again_under_its_number() -> None:
    async def body() -> None:
        runner, port, seen = await _serve(not_yet_for=0, drop_first=True)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=10)
        try:
            answer = await client.call("/status", Ask(node_id="n"), Answer)
        finally:
            await client.close()
            await runner.cleanup()
        assert answer.ok
        assert [status for _, status in seen] == [0, 200]
        assert seen[0][0] == seen[1][0]  # the same request, on the next connection
        assert client.channel.connections == 2

    asyncio.run(body())


def test_not_yet_for_ever_ends_after_the_patience(monkeypatch) -> None:
    monkeypatch.setattr(agent_client, "NOT_YET_PATIENCE", 0.5)

    async def body() -> None:
        runner, port, _ = await _serve(not_yet_for=60)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=0.1)
        started = time.monotonic()
        try:
            try:
                await client.call("/status", Ask(node_id="n"), Answer)
            except MasterUnreachable as exc:
                assert "kept saying" in str(exc)
            else:
                raise AssertionError("a master that never stops saying not yet was waited for")
        finally:
            await client.close()
            await runner.cleanup()
        assert time.monotonic() - started < 5

    asyncio.run(body())


def test_a_notice_wants_no_reply_and_a_refused_one_leaves_the_channel_open() -> None:
    async def body() -> None:
        runner, port, seen = await _serve(not_yet_for=0)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=10)
        try:
            assert await client.tell("/heartbeat", Ask(node_id="n"))
            # The refusal is logged; the request after it is answered on the same connection.
            answer = await client.call("/status", Ask(node_id="n"), Answer)
        finally:
            await client.close()
            await runner.cleanup()
        assert answer.ok
        assert seen[0] == (-1, 400) and seen[1][1] == 200
        assert client.channel.connections == 1

    asyncio.run(body())


def test_a_notice_without_a_master_is_not_sent_and_does_not_raise() -> None:
    async def body() -> None:
        with _bound() as sock:  # bound, not listening: nothing answers there
            port = sock.getsockname()[1]
            client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=0.1)
            try:
                assert not await client.tell("/heartbeat", Ask(node_id="n"))
            finally:
                await client.close()

    asyncio.run(body())
