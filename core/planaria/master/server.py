"""The master's HTTP/JSON API (aiohttp): one handler per row of the route table
(:data:`planaria.master.routes.ROUTES`). Every request needs the job's token, except the public
probe ``GET /healthz`` and, with ``master.metrics_public: true``, ``GET /metrics``.

Bad requests get 400 with what is wrong and where (bodies are read strictly, as their schema
says); an unknown node 404; a missing or wrong token 401, and nothing changes; a body over
``max_request_bytes`` 413, chunked or not. A client that sends its request too slowly (a
half-sent header or body) is cut off, and one address cannot hold more than a bounded number of
connections."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import math
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic_core
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, RootModel, ValidationError

from planaria.log import get_logger
from planaria.master import wire
from planaria.master.job import Master
from planaria.master.metrics import JobMetrics
from planaria.master.routes import JSON, ROUTES, Context, Route, UnknownRoute
from planaria.master.state import (
    BadReport,
    Conflict,
    FencedRequest,
    Held,
    NotAttached,
    RegistrationRefused,
    UnknownNode,
)
from planaria.protocol import ApiError, InvalidRequest

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
    max_request_bytes: int = 1 << 20
    """The largest request body served; a larger one is refused with 413."""


class _Connections:
    """The guard's book: connections per client address, and which guard owns a transport."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.guards: dict[asyncio.BaseTransport, _Guard] = {}
        self.refused = 0
        self._sweep: asyncio.TimerHandle | None = None
        self.hot: _Hot | None = None
        """Reads and answers the hot routes' requests at the byte level; None: the server
        serves every request."""

    def watch(self) -> None:
        """Look for connections past their deadline a few times per time limit: one timer
        for all of them, not one per request (10,000 nodes heart-beat 10,000 times a second)."""
        if self._sweep is None:
            every = min(1.0, self.limits.request_timeout / 4)
            self._sweep = asyncio.get_running_loop().call_later(every, self._expire_late)

    def _expire_late(self) -> None:
        self._sweep = None
        now = time.monotonic()
        for guard in list(self.guards.values()):
            if guard.deadline is not None and now >= guard.deadline:
                guard.expire()
        if self.guards:
            self.watch()


class _Guard(asyncio.Protocol):
    """Wraps one aiohttp connection protocol: a request header must be complete within the
    time limit from the connection's opening or the first byte of the request (aiohttp itself
    waits forever for a header that never ends), and a client address over its connection
    limit is cut off at once. A hot route's request that comes whole and plain is served by
    :class:`_Hot` instead of aiohttp, when aiohttp is between two requests."""

    def __init__(self, inner: RequestHandler, book: _Connections) -> None:
        self.inner = inner
        self.book = book
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.in_handler = False
        self.deadline: float | None = None
        """When the request now arriving must be in (monotonic clock); None: no request is."""
        self.framer = wire.Framer()
        """Where aiohttp's parser stands in what it was given of this connection."""
        self.serving = False
        """A hot request is being served; what comes meanwhile waits in :attr:`held`."""
        self.held = b""

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
        self.book.watch()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        if self.deadline is None and not self.in_handler:
            self.deadline = time.monotonic() + self.book.limits.request_timeout

    def expire(self) -> None:
        self.deadline = None
        if self.transport is not None and not self.in_handler:
            self.transport.close()

    def handler_entered(self) -> None:
        self.in_handler = True
        self.deadline = None

    def handler_left(self) -> None:
        self.in_handler = False

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.serving:  # pipelined behind a hot request: in order, after it
            if not self.held:
                self.transport.pause_reading()
            self.held += data
            return
        hot = self.book.hot
        if hot is not None and self.framer.between and hot.take(self, data):
            return
        self._arm()  # a new request starts: its header is due within the limit
        if hot is not None:
            self.framer.feed(data)
        self.inner.data_received(data)

    def served(self, answer: bytes | None, *, close: bool = False) -> None:
        """The hot request is answered (``answer``: the whole response; None: it was cut
        short, and so is the connection); what came meanwhile is read now."""
        self.serving = False
        inner = self.inner
        # What aiohttp does at the end of each request it serves: a shutdown waiting for it
        # goes on, and the connection's idle time starts again.
        inner._request_in_progress = False
        if inner._handler_waiter is not None and not inner._handler_waiter.done():
            inner._handler_waiter.set_result(None)
        inner._next_keepalive_close_time = inner._loop.time() + inner._keepalive_timeout
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if answer is None or close:
            if answer is not None:
                transport.write(answer)
            transport.close()
            return
        transport.write(answer)
        if self.held:
            held, self.held = self.held, b""
            transport.resume_reading()
            self.data_received(held)

    def eof_received(self) -> bool | None:
        if self.transport is not None:
            self.inner.eof_received()
        return None  # the transport closes itself

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.deadline = None
        self.book.guards.pop(self.transport, None)
        self.book.per_client[self.client] -= 1
        if self.book.per_client[self.client] <= 0:
            del self.book.per_client[self.client]
        self.inner.connection_lost(exc)


_AIOHTTP_STATE = (
    "_loop",
    "_waiter",
    "_messages",
    "_close",
    "_force_close",
    "_payload_parser",
    "_upgraded",
    "_request_in_progress",
    "_handler_waiter",
    "_next_keepalive_close_time",
    "_keepalive_timeout",
)
"""What :class:`_Hot` reads and keeps up of aiohttp's connection state, which is not public:
with an aiohttp that lacks any of it, aiohttp serves every request."""


class _Hot:
    """The hot routes' requests (:attr:`Route.hot`), read and answered at the byte level
    (:mod:`planaria.master.wire`) when one comes whole, in the plain form agents send, with
    the job's token and a valid body: at a fraction of what aiohttp's request machinery costs.
    Its answers, errors included, are those of the aiohttp path, byte for byte but the Date.
    Any other request (a bad token, a malformed or oversized body, a header it does not take)
    goes to aiohttp as it came, which answers it as always."""

    def __init__(
        self, routes: Sequence[Route], context: Context, expected: bytes, limits: ServerLimits
    ) -> None:
        self.routes = {r.path.encode(): r for r in routes}
        self.context = context
        self.expected = expected
        self.limits = limits
        self.taken = 0
        """Requests served here so far."""

    def take(self, guard: _Guard, data: bytes) -> bool:
        """Serve ``data`` if it is one whole hot request and aiohttp is idle on this
        connection (it waits for a request, and has nothing of one): whether it did."""
        inner = guard.inner
        if (
            inner._waiter is None
            or inner._messages
            or inner._close
            or inner._force_close
            or inner._payload_parser is not None
            or inner._upgraded
        ):
            return False
        found = wire.whole_request(data)
        if found is None:
            return False
        head, raw = found
        route = self.routes.get(head.target)
        if route is None or route.request is None or head.method != b"POST" or head.minor != 1:
            return False
        connection = head.fields.get(b"connection")
        if connection is not None and connection.lower() != b"keep-alive":
            return False
        if len(raw) > self.limits.max_request_bytes:
            return False
        if not hmac.compare_digest(head.fields.get(b"authorization", b""), self.expected):
            return False
        try:
            body = _parse(raw, route.request)
        except BadRequest:
            return False
        self.taken += 1
        guard.handler_entered()
        inner._request_in_progress = True
        inner._next_keepalive_close_time = inner._loop.time() + inner._keepalive_timeout
        guard.serving = True
        self._serve(guard, route, body)
        return True

    # Served by callbacks, not a task: a long poll is a future's done callback, its answer
    # another's on the journal's next write; no coroutine is made or resumed on the way.

    def _serve(self, guard: _Guard, route: Route, body: BaseModel) -> None:
        try:
            reply = route.call(self.context, body)
            if inspect.isawaitable(reply) and not isinstance(reply, Held):
                task = asyncio.ensure_future(reply)
                reply = Held(task, task.result)
        except Exception as exc:
            self._answer(guard, route, exc)
            return
        if isinstance(reply, Held):
            held = reply
            held.waiting.add_done_callback(lambda _: self._answer(guard, route, held))
        else:
            self._answer(guard, route, reply)

    def _answer(
        self, guard: _Guard, route: Route, reply: BaseModel | Held[BaseModel] | Exception
    ) -> None:
        try:
            if isinstance(reply, Exception):
                raise reply
            if isinstance(reply, Held):
                reply = reply.then()
            if not isinstance(reply, route.reply):
                raise TypeError(
                    f"{route.method} {route.path} answered {type(reply).__name__}, "
                    f"not its {route.reply.__name__}"
                )
            answer = wire.reply(200, reply.model_dump_json().encode())
        except asyncio.CancelledError:
            guard.handler_left()
            guard.served(None)  # given up: no answer, the connection is closed
            return
        except Exception as exc:
            answer = _wire_response(_refusal(exc, route.method, route.path))
        guard.handler_left()
        # On disk before it is answered, as every request (``timed``).
        try:
            written = self.context.master.journal_commit()
        except Exception as exc:
            self._written(guard, route, answer, exc)
            return
        if written is None:
            guard.served(answer)
        else:
            written.add_done_callback(lambda w: self._written(guard, route, answer, w))

    def _written(
        self,
        guard: _Guard,
        route: Route,
        answer: bytes,
        written: asyncio.Future[None] | Exception,
    ) -> None:
        if isinstance(written, asyncio.Future):
            if written.cancelled():
                guard.served(None)
                return
            failed = written.exception()
        else:
            failed = written
        if failed is None:
            guard.served(answer)
            return
        # The journal failed: answered as aiohttp answers a request whose serving raised,
        # and the connection closed.
        log.error(
            "API request failed",
            method=route.method,
            path=route.path,
            exc_info=failed,
        )
        guard.served(_failed(), close=True)


def _failed() -> bytes:
    return wire.reply(
        500,
        b"500 Internal Server Error\n\nServer got itself in trouble",
        reason=b"Internal Server Error",
        content_type=b"text/plain; charset=utf-8",
        fields=b"Connection: close\r\n",
    )


def _wire_response(response: web.Response) -> bytes:
    """A JSON response of the aiohttp path as bytes on the wire, as aiohttp writes them."""
    assert isinstance(response.body, bytes)
    fields = b"".join(
        f"{name}: {value}\r\n".encode()
        for name, value in response.headers.items()
        if name != "Content-Type"
    )
    return wire.reply(
        response.status, response.body, reason=response.reason.encode(), fields=fields
    )


def _json(
    model: BaseModel,
    status: int = 200,
    headers: dict[str, str] | None = None,
    *,
    exclude_defaults: bool = False,
) -> web.Response:
    return web.Response(
        text=model.model_dump_json(exclude_defaults=exclude_defaults),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error(
    status: int, message: str, *, retry: bool = False, headers: dict[str, str] | None = None
) -> web.Response:
    return _json(ApiError(error=message, retry=retry), status, headers, exclude_defaults=True)


def _invalid(message: str, problems: list[str]) -> web.Response:
    return _json(InvalidRequest(error=message, problems=problems), 400)


class BadRequest(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


async def _read(request: web.Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is over ``limit`` bytes: at once when its
    Content-Length says so, else when that many bytes came (a chunked body announces no size).
    Counted after any Content-Encoding is undone, so a small compressed body cannot expand
    past the limit either."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BadRequest(_too_large(f"{declared} bytes", limit))
    if request.content.is_eof():  # all of it came with the header: nothing to wait for
        whole = request.content.read_nowait()
        if len(whole) > limit:
            raise BadRequest(_too_large(f"{len(whole)} bytes", limit))
        return whole
    body = bytearray()
    while chunk := await request.content.readany():
        body.extend(chunk)
        if len(body) > limit:
            raise BadRequest(_too_large(f"at least {len(body)} bytes", limit))
    return bytes(body)


def _too_large(size: str, limit: int) -> web.Response:
    """413, and the connection closed after it: the rest of the body is never read, and
    would otherwise be taken for the next request."""
    response = _error(
        413, f"request body of {size} is over the limit of {limit} (master.max_request_bytes)"
    )
    response.force_close()
    return response


async def _body(request: web.Request, model: type[M]) -> M:
    limits = request.app[LIMITS]
    try:
        if request.content.is_eof():  # the usual small body, whole already: no timer, no task
            raw = await _read(request, limits.max_request_bytes)
        else:
            raw = await asyncio.wait_for(
                _read(request, limits.max_request_bytes), timeout=limits.request_timeout
            )
    except asyncio.TimeoutError:
        raise BadRequest(
            _error(408, f"the request body did not arrive within {limits.request_timeout:g}s")
        ) from None
    return _parse(raw, model)


def _parse(raw: bytes, model: type[M]) -> M:
    """A body read strictly as ``model`` says; BadRequest (400) naming what is wrong."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise BadRequest(_invalid(f"invalid {model.__name__}", [f"<body>: {exc}"])) from None
    if not _may_overflow(raw):  # no number can have become infinite: as agents send it
        try:
            return model.model_validate(data, strict=True)
        except ValidationError:
            pass  # perhaps 3.0 for 3: the numbers as JSON Schema reads them, below
    try:
        data = _numbers(data)
    except ValueError as exc:
        raise BadRequest(_invalid(f"invalid {model.__name__}", [f"<body>: {exc}"])) from None
    try:
        # Strict: a field is the JSON type its schema says (no "1" for 1, no false for 0.0),
        # as agents send it; what the document describes is what the server takes.
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        raise BadRequest(_invalid(f"invalid {model.__name__}", problems)) from None


_CLASSES = bytes(
    {**dict.fromkeys(b"0123456789", 48), 46: 46, 101: 101, 69: 101, 43: 43, 45: 43}.get(i, 32)
    for i in range(256)
)
"""Each byte's class: digit ``0``, point ``.``, exponent ``e``, sign ``+``, other ``" "``."""
_RUN = b"0" * 200


def _may_overflow(raw: bytes) -> bool:
    """Whether a JSON number in ``raw`` may overflow a float: a three-digit exponent after a
    digit or a point, or 200 digits in a row (fewer, times an exponent under 100, stay below
    1e299). A body without one is validated as it parsed, with no walk over its values.

    The bytes are mapped to their class (digit, point, exponent, sign, other) and the shapes
    looked for as plain substrings: several times faster than a regular expression, which
    costs more than the parse itself on a heartbeat of 8 ranks."""
    shape = raw.translate(_CLASSES)
    if _RUN in shape:
        return True
    if b"e000" not in shape and b"e+000" not in shape:  # the usual body: no exponent so large
        return False
    return any(s in shape for s in (b"0e000", b".e000", b"0e+000", b".e+000"))


def _numbers(value: Any) -> Any:
    """JSON numbers as JSON Schema reads them: ``3.0`` is the integer 3 (a client in a language
    with one number type cannot tell them apart), and a number too large for a float (``1e999``)
    is refused rather than taken as infinity."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number is out of range")
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return value


def _handler(route: Route, context: Context) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = None if route.request is None else await _body(request, route.request)
        reply = route.call(context, body)
        if isinstance(reply, Held):
            await reply.waiting
            reply = reply.then()
        elif inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, route.reply):
            raise TypeError(
                f"{route.method} {route.path} answered {type(reply).__name__}, "
                f"not its {route.reply.__name__}"
            )
        if route.media_type != JSON:
            assert isinstance(reply, RootModel)
            text = str(reply.root).encode()
            return web.Response(body=text, headers={"Content-Type": route.media_type})
        return _json(reply)

    return handle


def _refusal(exc: Exception, method: str, path: str) -> web.Response:
    """The answer to a request whose serving raised ``exc`` (called in its ``except``)."""
    if isinstance(exc, BadRequest):
        return exc.response
    if isinstance(exc, FencedRequest):
        return _error(410, str(exc))
    if isinstance(exc, NotAttached):
        return _error(409, f"node {exc.args[0]!r}: re-attach first (a new master)")
    if isinstance(exc, UnknownRoute):
        return _error(404, str(exc))
    if isinstance(exc, UnknownNode):
        return _error(404, f"unknown node {exc.args[0]!r}: register first")
    if isinstance(exc, BadReport):
        return _invalid(str(exc), [])
    if isinstance(exc, Conflict):
        return _error(409, str(exc))
    if isinstance(exc, RegistrationRefused):
        if exc.retry:
            return _error(503, str(exc), retry=True)
        return _error(403, str(exc))
    log.exception("API request failed", method=method, path=path)
    return _error(500, f"the master failed to serve {path}: {exc!r}")


LIMITS: web.AppKey[ServerLimits] = web.AppKey("limits", ServerLimits)
BOOK: web.AppKey[_Connections] = web.AppKey("connections", _Connections)
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="planaria"'}


def make_app(
    master: Master,
    token: str,
    hold: float,
    limits: ServerLimits | None = None,
    *,
    join_hold: float = 5.0,
    routes: Sequence[Route] = ROUTES,
    public_with: Collection[str] = (),
    binding: Callable[[str], str] | None = None,
) -> web.Application:
    """The API of ``master``, one handler per row of ``routes``. ``hold``: the longest a
    heartbeat or pre-flight long poll holds a request; ``join_hold``: a rendezvous join;
    ``public_with``: the config options set to true that serve routes without the token
    (:attr:`Route.public_with`); ``binding``: the proof ``POST /v1/bind`` answers
    (:func:`planaria.master.binding.prover`), None without TLS."""
    expected = f"Bearer {token}".encode()
    public = {
        (r.method, r.path)
        for r in routes
        if r.public or (r.public_with is not None and r.public_with in public_with)
    }

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
            # What the request changed is on disk before it is answered: one write for all
            # the requests answered in this turn of the loop (a group commit).
            await master.journal_committed()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.method, request.path) not in public:
            # aiohttp decodes header bytes that are not UTF-8 as surrogates: take the bytes
            # back as they came, so that any header is a plain mismatch (401), never an error.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                return _error(
                    401,
                    "missing or wrong token (Authorization: Bearer <job token>)",
                    headers=_CHALLENGE,
                )
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return _error(
                exc.status, f"{request.method} {request.path}: {exc.reason}", headers=allow
            )
        except Exception as exc:
            return _refusal(exc, request.method, request.path)

    limits = limits or ServerLimits()
    app = web.Application(middlewares=[timed, guard], client_max_size=limits.max_request_bytes)
    app[LIMITS] = limits
    app[BOOK] = _Connections(limits)
    context = Context(
        master=master,
        hold=hold,
        join_hold=join_hold,
        metrics=JobMetrics(master),
        binding=binding,
    )
    for route in routes:
        app.router.add_route(route.method, route.path, _handler(route, context))
    hot = [r for r in routes if r.hot and r.request is not None and r.media_type == JSON]
    if hot and all(hasattr(RequestHandler, name) for name in _AIOHTTP_STATE):
        app[BOOK].hot = _Hot(
            [r for r in hot if (r.method, r.path) not in public], context, expected, limits
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
