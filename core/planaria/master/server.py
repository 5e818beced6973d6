"""The master's HTTP/JSON API (aiohttp). Every request needs the job's token.

Bad requests get 400 with what is wrong and where; an unknown node 404; a missing or wrong
token 401, and nothing changes. A client that sends its request too slowly (a half-sent header or
body) is cut off, and one address cannot hold more than a bounded number of connections.
"""

from __future__ import annotations

import asyncio
import hmac
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from planaria.diagnosis.messages import HangReport, HealthReport, PreflightPoll, PreflightResult
from planaria.log import get_logger
from planaria.master.job import Master
from planaria.master.state import BadReport, Fenced, NotAttached, RegistrationRefused
from planaria.protocol import (
    API_PREFIX,
    Ack,
    ChaosReport,
    CheckpointEvent,
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    ReattachRequest,
    RegisterReply,
    RegisterRequest,
    WorkersReport,
)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = get_logger("master")


@dataclass(frozen=True)
class ServerLimits:
    request_timeout: float = 10.0
    """From a connection's first byte (or its opening) to a complete request header, and from
    the header to the end of the body."""
    per_client: int = 1024
    """Connections one client address may hold at once."""


class _Connections:
    """The guard's book: connections per client address, and which guard owns a transport."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.guards: dict[asyncio.BaseTransport, _Guard] = {}
        self.refused = 0


class _Guard(asyncio.Protocol):
    """Wraps one aiohttp connection protocol: a request header must be complete within the
    time limit from the connection's opening or the first byte of the request (aiohttp itself
    waits forever for a header that never ends), and a client address over its connection
    limit is cut off at once."""

    def __init__(self, inner: asyncio.Protocol, book: _Connections) -> None:
        self.inner = inner
        self.book = book
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.in_handler = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.book.per_client[self.client] >= self.book.limits.per_client:
            self.book.refused += 1
            if self.book.refused == 1 or self.book.refused % 1000 == 0:
                log.warning(
                    "connection refused: too many from one client",
                    client=self.client,
                    limit=self.book.limits.per_client,
                    refused=self.book.refused,
                )
            transport.abort()
            return
        self.transport = transport
        self.book.per_client[self.client] += 1
        self.book.guards[transport] = self
        self._arm()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        if self._timer is None and not self.in_handler:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.book.limits.request_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport is not None and not self.in_handler:
            self.transport.close()

    def handler_entered(self) -> None:
        self.in_handler = True
        self._disarm()

    def handler_left(self) -> None:
        self.in_handler = False

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        self._arm()  # a new request starts: its header is due within the limit
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.transport is not None else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self._disarm()
        self.book.guards.pop(self.transport, None)
        self.book.per_client[self.client] -= 1
        if self.book.per_client[self.client] <= 0:
            del self.book.per_client[self.client]
        self.inner.connection_lost(exc)


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
    limit: float = request.app[LIMITS].request_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout=limit)
    except asyncio.TimeoutError:
        raise BadRequest(
            _error(408, f"the request body did not arrive within {limit:g}s")
        ) from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        raise BadRequest(_error(400, f"invalid {model.__name__}", problems=problems)) from None


LIMITS: web.AppKey[ServerLimits] = web.AppKey("limits", ServerLimits)
BOOK: web.AppKey[_Connections] = web.AppKey("connections", _Connections)


def make_app(
    master: Master, token: str, hold: float, limits: ServerLimits | None = None
) -> web.Application:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def timed(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Tell the connection's guard that its header is in: from here the body's own time
        limit applies, and a long poll may hold the request."""
        guard = request.app[BOOK].guards.get(request.transport)  # type: ignore[arg-type]
        if guard is not None:
            guard.handler_entered()
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.handler_left()
            master.write_journal()  # what the request changed is on disk before it is answered

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: take the bytes back
        # as they came, so that any header is a plain mismatch (401), never an error.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            return _error(401, "missing or wrong token (Authorization: Bearer <job token>)")
        try:
            return await handler(request)
        except BadRequest as bad:
            return bad.response
        except Fenced as exc:
            return _error(410, str(exc), fenced=True)
        except NotAttached as exc:
            return _error(409, f"node {exc.args[0]!r}: re-attach first (a new master)")
        except KeyError as exc:
            return _error(404, f"unknown node {exc.args[0]!r}: register first")
        except BadReport as exc:
            return _error(400, str(exc))
        except RegistrationRefused as exc:
            if exc.retry:
                return _error(503, str(exc), retry=True)
            return _error(403, str(exc))

    async def register(request: web.Request) -> web.StreamResponse:
        body = await _body(request, RegisterRequest)
        return _json(RegisterReply(spec=master.register(body)))

    async def reattach(request: web.Request) -> web.StreamResponse:
        return _json(master.reattach(await _body(request, ReattachRequest)))

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
        master.diagnosis.chaos(await _body(request, ChaosReport))
        return _json(Ack())

    async def checkpoint(request: web.Request) -> web.StreamResponse:
        master.checkpoint_event(await _body(request, CheckpointEvent))
        return _json(Ack())

    async def hang(request: web.Request) -> web.StreamResponse:
        master.diagnosis.hang(await _body(request, HangReport))
        return _json(Ack())

    async def health(request: web.Request) -> web.StreamResponse:
        master.diagnosis.unhealthy(await _body(request, HealthReport))
        return _json(Ack())

    async def preflight_next(request: web.Request) -> web.StreamResponse:
        return _json(await master.preflight.next(await _body(request, PreflightPoll), hold))

    async def preflight_result(request: web.Request) -> web.StreamResponse:
        master.preflight.result(await _body(request, PreflightResult))
        return _json(Ack())

    async def status(request: web.Request) -> web.StreamResponse:
        return _json(master.status())

    app = web.Application(middlewares=[timed, guard], client_max_size=1 << 20)
    app[LIMITS] = limits or ServerLimits()
    app[BOOK] = _Connections(app[LIMITS])
    app.add_routes(
        [
            web.post(f"{API_PREFIX}/register", register),
            web.post(f"{API_PREFIX}/reattach", reattach),
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


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections go through :class:`_Guard`."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        book: _Connections,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, backlog=4096)
        self._host, self._port, self._book = host, port, book
        self._ssl = ssl_context
        self.bound_port = port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{self._host}:{self.bound_port}"

    async def start(self) -> None:
        await super().start()
        factory = self._runner.server
        assert factory is not None
        book = self._book

        def protocol() -> asyncio.Protocol:
            return _Guard(factory(), book)

        loop = asyncio.get_running_loop()
        # A TLS handshake comes before the guard sees the connection: it has the request's
        # time limit of its own, so that a client cannot hold a connection by never finishing it.
        handshake = None if self._ssl is None else book.limits.request_timeout
        self._server = server = await loop.create_server(
            protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            ssl=self._ssl,
            ssl_handshake_timeout=handshake,
        )
        self.bound_port = int(server.sockets[0].getsockname()[1])


async def serve(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Start serving, over TLS with ``ssl_context``; returns the runner
    (``await runner.cleanup()`` to stop) and the port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = _GuardedSite(runner, host, port, app[BOOK], ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site.bound_port
