"""The agent's end of its channel to the master: one WebSocket (``GET /v1/channel``) that
carries every request of the agent and every reply of the master, the master's actions
included, pushed the moment it decides them (:mod:`planaria.master.channel` has the messages).

A request keeps its sequence number through every try: sent again on a new connection after the
old one dropped, it is answered once (the master keeps its reply until the agent has it). The
connection is made when a request needs it and watched by pings: a master cut off by the
network is noticed within 1.5 ``ping`` seconds, and the requests in flight fail over to the
caller's retries (:class:`planaria.agent.client.MasterClient`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Any

import aiohttp

from planaria.background import Running
from planaria.log import get_logger
from planaria.protocol import API_PREFIX

log = get_logger("agent")


class ChannelClosed(ConnectionError):
    """The channel closed with requests in flight: they are sent again on the next one."""


class ChannelRefused(Exception):
    """The master refused the channel itself (its HTTP status): no retry helps."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Channel:
    """``session``: the HTTP session (its headers carry the job's token); ``ssl``: as for its
    requests (the certificate's pin); ``ping``: seconds between two pings of the master."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        ssl: aiohttp.Fingerprint | bool,
        ping: float = 10.0,
    ) -> None:
        self.client_id = secrets.token_hex(8)
        self.url = f"{url}{API_PREFIX}/channel?client={self.client_id}"
        self.ping = ping
        self._session = session
        self._ssl = ssl
        self._ws: aiohttp.ClientWebSocketResponse[bool] | None = None
        self._connecting: asyncio.Future[aiohttp.ClientWebSocketResponse[bool]] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[tuple[int, Any]]] = {}
        self._open: set[int] = set()
        """Sequence numbers whose reply has not come yet (in flight, or between two tries)."""
        self._next = 1
        self._tasks: Running[asyncio.Future[None]] = Running()
        self.connections = 0
        """Connections made so far (the first, and one per reconnect)."""

    def number(self) -> int:
        """A new request's sequence number, open until :meth:`done` is told it."""
        seq = self._next
        self._next += 1
        self._open.add(seq)
        return seq

    def done(self, seq: int) -> None:
        """The request ``seq`` got its reply, or was given up: the master may forget it."""
        self._open.discard(seq)

    async def ask(self, seq: int, op: str, body: str) -> tuple[int, Any]:
        """Send request ``seq`` (``body``: its JSON) and wait for the reply: its status and its
        body as JSON parsed it. Raises :class:`ChannelClosed` (or an aiohttp error) when the
        channel is lost meanwhile, and :class:`ChannelRefused` when the master refuses it."""
        ws = await self._connected()
        reply: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = reply
        waiting = ",".join(map(str, sorted(self._open)))  # every reply not among them came
        try:
            message = f'{{"seq":{seq},"op":{json.dumps(op)},"open":[{waiting}],"body":{body}}}'
            await ws.send_str(message)
            return await reply
        except asyncio.CancelledError:
            if not ws.closed and not reply.done():
                self._tasks.start(ws.send_str(f'{{"cancel":{seq}}}'))
            raise
        finally:
            self._waiting.pop(seq, None)

    async def tell(self, op: str, body: str) -> None:
        """Send a notice: ``op`` with ``body`` (its JSON), no reply wanted. Lost if the
        connection drops meanwhile (a notice is what the next one says again); raises as
        :meth:`ask` when there is no connection to be had."""
        ws = await self._connected()
        await ws.send_str(f'{{"op":{json.dumps(op)},"body":{body}}}')

    async def _connected(self) -> aiohttp.ClientWebSocketResponse[bool]:
        if self._ws is not None and not self._ws.closed:
            return self._ws
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None

    async def _connect(self) -> aiohttp.ClientWebSocketResponse[bool]:
        try:
            ws = await self._session.ws_connect(
                self.url,
                ssl=self._ssl,
                heartbeat=self.ping,
                autoping=True,
                timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
            )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403, 404):
                raise ChannelRefused(exc.status, exc.message) from None
            raise
        self._ws = ws
        self.connections += 1
        if self.connections > 1:
            log.info("the channel to the master is open again", connections=self.connections)
        self._reader = asyncio.ensure_future(self._read(ws))
        return ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
        why = "the master closed the channel"
        try:
            async for message in ws:
                if message.type is not aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    data = json.loads(message.data)
                    seq, status, body = data["re"], int(data["status"]), data["body"]
                except (ValueError, KeyError, TypeError) as exc:
                    why = f"the master sent a message this agent cannot read: {exc}"
                    break
                if seq is None and "op" in data:  # a notice refused
                    error = body.get("error", body) if isinstance(body, dict) else body
                    log.error(
                        "the master refused a notice", op=data["op"], status=status, error=error
                    )
                    continue
                if seq is None:  # about the channel itself: it is closed after it
                    why = f"the master refused a message: {body.get('error', body)}"
                    log.error("the master refused a channel message", error=why)
                    continue
                reply = self._waiting.get(seq)
                if reply is not None and not reply.done():
                    reply.set_result((status, body))
        except Exception as exc:  # the connection broke: its requests are tried again
            why = f"the channel to the master broke: {exc!r}"
        finally:
            if ws.close_code is not None and ws.close_code != 1000:
                why = f"{why} (code {ws.close_code})"
            if self._ws is ws:
                self._ws = None
            await ws.close()
            for reply in list(self._waiting.values()):
                if not reply.done():
                    reply.set_exception(ChannelClosed(why))

    async def drop(self) -> None:
        """Close the connection (tests, and a cut the caller noticed first); requests in flight
        fail over to their retries."""
        ws = self._ws
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def close(self) -> None:
        await self.drop()
        for task in self._tasks:
            task.cancel()
