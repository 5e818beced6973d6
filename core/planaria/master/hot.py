"""The hot path: the hot routes' requests read and answered at the byte level
(:mod:`planaria.master.wire`), past aiohttp's request machinery, when the connection's guard
(:mod:`planaria.master.guard`) sees one come whole.

It reads and keeps up aiohttp's private connection state, so it stays apart from the server
it stands beside: an aiohttp without that state gets no hot path, and every request goes the
ordinary way (:mod:`planaria.master.server`)."""

from __future__ import annotations

import asyncio
import hmac
import inspect
from collections.abc import Sequence

from aiohttp import web
from pydantic import BaseModel

from planaria.log import get_logger
from planaria.master import wire
from planaria.master.body import parse
from planaria.master.guard import Guard, ServerLimits
from planaria.master.responses import BadRequest, refusal
from planaria.master.routes import Context, Route
from planaria.master.state import Deferred

log = get_logger("master")


AIOHTTP_STATE = (
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
"""What :class:`Hot` reads and keeps up of aiohttp's connection state, which is not public:
with an aiohttp that lacks any of it, aiohttp serves every request."""


class Hot:
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

    def take(self, guard: Guard, data: bytes) -> bool:
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
            body = parse(raw, route.request)
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

    def _serve(self, guard: Guard, route: Route, body: BaseModel) -> None:
        try:
            reply = route.call(self.context, body)
            if inspect.isawaitable(reply) and not isinstance(reply, Deferred):
                task = asyncio.ensure_future(reply)
                reply = Deferred(task, task.result)
        except Exception as exc:
            self._answer(guard, route, exc)
            return
        if isinstance(reply, Deferred):
            deferred = reply
            deferred.waiting.add_done_callback(lambda _: self._answer(guard, route, deferred))
        else:
            self._answer(guard, route, reply)

    def _answer(
        self, guard: Guard, route: Route, reply: BaseModel | Deferred[BaseModel] | Exception
    ) -> None:
        try:
            if isinstance(reply, Exception):
                raise reply
            if isinstance(reply, Deferred):
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
            answer = wire_response(refusal(exc, route.method, route.path))
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
        guard: Guard,
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
        guard.served(internal_error(), close=True)


def internal_error() -> bytes:
    return wire.reply(
        500,
        b"500 Internal Server Error\n\nServer got itself in trouble",
        reason=b"Internal Server Error",
        content_type=b"text/plain; charset=utf-8",
        fields=b"Connection: close\r\n",
    )


def wire_response(response: web.Response) -> bytes:
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
