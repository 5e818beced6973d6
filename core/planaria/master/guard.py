"""The connection guard of the master's API: every connection of the server goes through a
:class:`Guard`, which cuts off a client that sends its request header too slowly (aiohttp itself
waits forever for a header that never ends) and one address that holds more connections than
its limit. It knows nothing of the routes or the job, and stands before aiohttp's connection
handler through its public interface (an asyncio protocol) only."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web

from planaria.log import get_logger

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


class Connections:
    """The guard's book: connections per client address, and which guard owns a transport."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.guards: dict[asyncio.BaseTransport, Guard] = {}
        self.refused = 0
        self._sweep: asyncio.TimerHandle | None = None

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
    limit is cut off at once."""

    def __init__(self, inner: asyncio.Protocol, book: Connections) -> None:
        self.inner = inner
        self.book = book
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.in_handler = False
        self.deadline: float | None = None
        """When the request now arriving must be in (monotonic clock); None: no request is."""

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
        self._arm()  # a new request starts: its header is due within the limit
        self.inner.data_received(data)

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


def guard_of(request: web.Request) -> Guard | None:
    """The guard of ``request``'s connection (None once the connection is gone)."""
    return request.app[BOOK].guards.get(request.transport)  # type: ignore[arg-type]


def handler_left(request: web.Request) -> None:
    """``request`` is answered without its handler's frame around it to say so (a channel
    refused before its upgrade): its connection's next request header is timed again."""
    guard = guard_of(request)
    if guard is not None:
        guard.handler_left()


class Listener:
    """The server's listening socket, whose connections go through :class:`Guard`, in front of
    an aiohttp runner (set up): what ``aiohttp.web.TCPSite`` does, with the guard."""

    def __init__(
        self, runner: web.AppRunner, book: Connections, ssl_context: ssl.SSLContext | None
    ) -> None:
        self.runner = runner
        self.book = book
        self.ssl = ssl_context
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        factory = self.runner.server
        assert factory is not None, "the runner is set up first"
        book = self.book

        def protocol() -> asyncio.Protocol:
            return Guard(factory(), book)

        loop = asyncio.get_running_loop()
        # A TLS handshake comes before the guard sees the connection: it has the request's
        # time limit of its own, so that a client cannot hold a connection by never finishing it.
        handshake = None if self.ssl is None else book.limits.request_timeout
        self.server = await loop.create_server(
            protocol,
            host,
            port,
            backlog=4096,
            reuse_address=True,
            ssl=self.ssl,
            ssl_handshake_timeout=handshake,
        )
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def cleanup(self) -> None:
        """Stop listening, then shut the app down (its connections closed, its handlers done)."""
        if self.server is not None:
            self.server.close()
        await self.runner.cleanup()
