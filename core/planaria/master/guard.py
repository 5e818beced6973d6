"""The connection guard of the master's API: every connection of the server goes through a
:class:`Guard`, which cuts off a client that sends its request header too slowly (aiohttp itself
waits forever for a header that never ends) and one address that holds more connections than
its limit, and hands a hot route's whole request to the hot path (:mod:`planaria.master.hot`)
when aiohttp is between two requests. It knows nothing of the routes or the job."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from planaria.log import get_logger
from planaria.master import wire

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


class HotPath(Protocol):
    """What serves a hot route's request past aiohttp (:class:`planaria.master.hot.Hot`)."""

    def take(self, guard: Guard, data: bytes) -> bool:
        """Serve ``data`` if it is one whole hot request aiohttp is idle for: whether it did."""
        ...


class Connections:
    """The guard's book: connections per client address, and which guard owns a transport."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.guards: dict[asyncio.BaseTransport, Guard] = {}
        self.refused = 0
        self._sweep: asyncio.TimerHandle | None = None
        self.hot: HotPath | None = None
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


class Guard(asyncio.Protocol):
    """Wraps one aiohttp connection protocol: a request header must be complete within the
    time limit from the connection's opening or the first byte of the request (aiohttp itself
    waits forever for a header that never ends), and a client address over its connection
    limit is cut off at once. A hot route's request that comes whole and plain is served by
    :class:`Hot` instead of aiohttp, when aiohttp is between two requests."""

    def __init__(self, inner: RequestHandler, book: Connections) -> None:
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
        """A hot request is being served; what comes meanwhile waits in :attr:`queued`."""
        self.queued = b""

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
            if not self.queued:
                self.transport.pause_reading()
            self.queued += data
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
        if self.queued:
            queued, self.queued = self.queued, b""
            transport.resume_reading()
            self.data_received(queued)

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


LIMITS: web.AppKey[ServerLimits] = web.AppKey("limits", ServerLimits)
BOOK: web.AppKey[Connections] = web.AppKey("connections", Connections)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through :class:`Guard`."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        book: Connections,
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
            return Guard(factory(), book)

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
