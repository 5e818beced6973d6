"""The master's HTTP/JSON API (aiohttp): one handler per row of the route table
(:data:`planaria.master.routes.ROUTES`). Every request needs the job's token, except the public
probe ``GET /healthz`` and, with ``master.metrics_public: true``, ``GET /metrics``.

Bad requests get 400 with what is wrong and where (bodies are read strictly, as their schema
says); an unknown node 404; a missing or wrong token 401, and nothing changes; a body over
``max_request_bytes`` 413, chunked or not. A client that sends its request too slowly (a
half-sent header or body) is cut off, and one address cannot hold more than a bounded number of
connections.

The parts around it, each an idea of its own: the connection guard (:mod:`planaria.master.guard`),
a body read and parsed (:mod:`planaria.master.body`), the answers and refusals
(:mod:`planaria.master.responses`) and the agents' channel (:mod:`planaria.master.channel`).
This module makes the app from the route table and serves it, on aiohttp's public API only."""

from __future__ import annotations

import hmac
import inspect
import ssl
from collections.abc import Awaitable, Callable, Collection, Sequence

from aiohttp import web
from pydantic import RootModel

from planaria.master import channel
from planaria.master.body import read_body
from planaria.master.guard import (
    BOOK,
    LIMITS,
    Connections,
    Guard,
    Listener,
    ServerLimits,
    guard_of,
    handler_left,
)
from planaria.master.job import Master
from planaria.master.metrics import JobMetrics
from planaria.master.responses import BadRequest, error, json_response, refused
from planaria.master.routes import CHANNEL_ROUTES, JSON, ROUTES, Context, Route
from planaria.master.state import Deferred

__all__ = ["BOOK", "CHANNELS", "LIMITS", "BadRequest", "ServerLimits", "make_app", "serve"]

CHANNELS: web.AppKey[channel.Channels] = web.AppKey("channels", channel.Channels)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="planaria"'}


async def _now(response: web.StreamResponse) -> web.StreamResponse:
    return response


def _opens_a_channel(request: web.Request) -> bool:
    """Served by the channel's handler itself (another method on its path is aiohttp's 405,
    which the middleware answers as the API's)."""
    return request.method == "GET" and request.path == channel.PATH


def _handler(route: Route, context: Context) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = None if route.request is None else await read_body(request, route.request)
        reply = route.call(context, body)
        if isinstance(reply, Deferred):
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
        return json_response(reply)

    return handle


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
    def timed(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
        """Tell the connection's guard that its header is in: from here the body's own time
        limit applies, and a long poll may hold the request."""
        guard = guard_of(request)
        if guard is not None:
            guard.handler_entered()
        if _opens_a_channel(request):
            # A channel lives as long as its agent, and sends each reply after its journal
            # write: no frame of a middleware stands beside it (memory, at 10,000 agents).
            return handler(request)
        return answered(request, handler, guard)

    async def answered(
        request: web.Request, handler: Handler, guard: Guard | None
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.handler_left()
            # What the request changed is on disk before it is answered: one write for all
            # the requests answered in this turn of the loop (a group commit).
            await master.journal_committed()

    @web.middleware
    def guard(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
        if (request.method, request.path) not in public:
            # aiohttp decodes header bytes that are not UTF-8 as surrogates: take the bytes
            # back as they came, so that any header is a plain mismatch (401), never an error.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                if _opens_a_channel(request):
                    handler_left(request)  # timed() has no frame to say it
                return _now(
                    error(
                        401,
                        "missing or wrong token (Authorization: Bearer <job token>)",
                        headers=_CHALLENGE,
                    )
                )
        if _opens_a_channel(request):
            return handler(request)  # refuses as below itself, with no frame of this one
        return guarded(request, handler)

    async def guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return refused(request, exc)

    limits = limits or ServerLimits()
    app = web.Application(middlewares=[timed, guard], client_max_size=limits.max_request_bytes)
    app[LIMITS] = limits
    app[BOOK] = Connections(limits)
    context = Context(
        master=master,
        hold=hold,
        join_hold=join_hold,
        metrics=JobMetrics(master),
        binding=binding,
    )
    for route in routes:
        app.router.add_route(route.method, route.path, _handler(route, context))
    channels = channel.Channels([r for r in (*routes, *CHANNEL_ROUTES) if r.channel], context)
    app[CHANNELS] = channels
    app.router.add_get(channel.PATH, channels.serve)

    async def close_channels(_: web.Application) -> None:
        await channels.close_all()

    app.on_shutdown.append(close_channels)
    return app


async def serve(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> tuple[Listener, int]:
    """Start serving, over TLS with ``ssl_context``; returns the server
    (``await server.cleanup()`` to stop) and the port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    listener = Listener(runner, app[BOOK], ssl_context)
    try:
        await listener.start(host, port)
    except BaseException:
        await runner.cleanup()
        raise
    return listener, listener.port
