"""The master's HTTP/JSON API (aiohttp). Every request needs the job's token.

Bad requests get 400 with what is wrong and where; an unknown node 404; a missing or wrong
token 401, and nothing changes.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from planaria.diagnosis.messages import HangReport, HealthReport, PreflightPoll, PreflightResult
from planaria.master.job import BadReport, Master
from planaria.protocol import (
    API_PREFIX,
    Ack,
    ChaosReport,
    CheckpointEvent,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    RegisterReply,
    RegisterRequest,
    WorkersReport,
)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        text=model.model_dump_json(), status=status, content_type="application/json"
    )


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


class BadRequest(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


async def _body(request: web.Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        raise BadRequest(_error(400, f"invalid {model.__name__}", problems=problems)) from None


def make_app(master: Master, token: str, hold: float) -> web.Application:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _error(401, "missing or wrong token (Authorization: Bearer <job token>)")
        try:
            return await handler(request)
        except BadRequest as bad:
            return bad.response
        except KeyError as exc:
            return _error(404, f"unknown node {exc.args[0]!r}: register first")
        except BadReport as exc:
            return _error(400, str(exc))

    async def register(request: web.Request) -> web.StreamResponse:
        body = await _body(request, RegisterRequest)
        return _json(RegisterReply(spec=master.register(body)))

    async def join(request: web.Request) -> web.StreamResponse:
        return _json(await master.join(await _body(request, JoinRequest)))

    async def heartbeat(request: web.Request) -> web.StreamResponse:
        beat = await _body(request, Heartbeat)
        action = await master.heartbeat(beat, hold if beat.wait else 0.0)
        return _json(HeartbeatReply(action=action))

    async def workers(request: web.Request) -> web.StreamResponse:
        master.workers_report(await _body(request, WorkersReport))
        return _json(Ack())

    async def chaos(request: web.Request) -> web.StreamResponse:
        master.chaos(await _body(request, ChaosReport))
        return _json(Ack())

    async def checkpoint(request: web.Request) -> web.StreamResponse:
        master.checkpoint_event(await _body(request, CheckpointEvent))
        return _json(Ack())

    async def hang(request: web.Request) -> web.StreamResponse:
        master.hang(await _body(request, HangReport))
        return _json(Ack())

    async def health(request: web.Request) -> web.StreamResponse:
        master.unhealthy(await _body(request, HealthReport))
        return _json(Ack())

    async def preflight_next(request: web.Request) -> web.StreamResponse:
        return _json(await master.preflight.next(await _body(request, PreflightPoll), hold))

    async def preflight_result(request: web.Request) -> web.StreamResponse:
        master.preflight.result(await _body(request, PreflightResult))
        return _json(Ack())

    async def status(request: web.Request) -> web.StreamResponse:
        return _json(master.status())

    app = web.Application(middlewares=[guard], client_max_size=1 << 20)
    app.add_routes(
        [
            web.post(f"{API_PREFIX}/register", register),
            web.post(f"{API_PREFIX}/rendezvous/join", join),
            web.post(f"{API_PREFIX}/heartbeat", heartbeat),
            web.post(f"{API_PREFIX}/workers", workers),
            web.post(f"{API_PREFIX}/chaos", chaos),
            web.post(f"{API_PREFIX}/checkpoint/event", checkpoint),
            web.post(f"{API_PREFIX}/hang", hang),
            web.post(f"{API_PREFIX}/health", health),
            web.post(f"{API_PREFIX}/preflight/next", preflight_next),
            web.post(f"{API_PREFIX}/preflight/result", preflight_result),
            web.get(f"{API_PREFIX}/status", status),
        ]
    )
    return app


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` to stop) and the port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    return runner, int(sockets[0].getsockname()[1])
