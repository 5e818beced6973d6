"""The agent's client of the master: while the master answers "not yet" (503, its node's launch
in flight), it keeps asking, past the time it would give an unreachable master, as long as a
launch may take (a scheduler that returns once every node runs keeps early agents waiting)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from pydantic import BaseModel

from planaria.agent import client as agent_client
from planaria.agent.client import MasterClient, MasterUnreachable
from planaria.protocol import API_PREFIX


class Answer(BaseModel):
    ok: bool


async def _serve(not_yet_for: float) -> tuple[web.AppRunner, int, list[int]]:
    started = time.monotonic()
    seen: list[int] = []

    async def status(request: web.Request) -> web.Response:
        if time.monotonic() - started < not_yet_for:
            seen.append(503)
            return web.json_response(
                {"error": "not known yet; ask again", "retry": True}, status=503
            )
        seen.append(200)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get(f"{API_PREFIX}/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port, seen


def test_not_yet_is_waited_out_past_the_unreachable_grace() -> None:
    async def body() -> None:
        runner, port, seen = await _serve(not_yet_for=1.5)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=0.3)
        try:
            answer = await client.call("/status", None, Answer)
        finally:
            await client.close()
            await runner.cleanup()
        assert answer.ok
        assert seen.count(503) >= 2 and seen[-1] == 200

    asyncio.run(body())


def test_not_yet_for_ever_ends_after_the_patience(monkeypatch) -> None:
    monkeypatch.setattr(agent_client, "NOT_YET_PATIENCE", 0.5)

    async def body() -> None:
        runner, port, _ = await _serve(not_yet_for=60)
        client = MasterClient(f"http://127.0.0.1:{port}", "t", give_up_after=0.1)
        started = time.monotonic()
        try:
            try:
                await client.call("/status", None, Answer)
            except MasterUnreachable as exc:
                assert "kept saying" in str(exc)
            else:
                raise AssertionError("a master that never stops saying not yet was waited for")
        finally:
            await client.close()
            await runner.cleanup()
        assert time.monotonic() - started < 5

    asyncio.run(body())
