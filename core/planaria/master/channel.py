"""The agents' channel: one WebSocket per agent (``GET /v1/channel``), on aiohttp's public API.

An agent sends its requests up the channel as text messages, each the JSON object
``{"seq": N, "op": PATH, "body": {...}, "open": [...]}``: ``op`` names a node route of the API
(:data:`planaria.master.routes.ROUTES`, such as ``/heartbeat``) or one of the channel's own
(:data:`planaria.master.routes.CHANNEL_ROUTES`, ``/actions``), and ``body`` is that route's
request model, read as strictly as over HTTP. The master answers each one with
``{"re": N, "status": S, "body": {...}}``: the reply the route's HTTP form answers, with the same
status (200, or an error such as 409 "re-attach first" and 410 "fenced", whose body is the
error's JSON).

- **Pushed, not polled.** A request may be answered later: ``/actions`` (the node's next
  action: start a round, restart, exit, or a 410 when it is fenced) is answered the moment the
  master decides it, a join when its round closes. No request is held by a timer; the agent's
  heartbeats carry only its progress.
- **After the journal.** A reply is sent once what its request changed is in the journal (the
  replies of one turn of the loop share one write), as over HTTP; but a reply that tells of
  nothing decided (a heartbeat's "nothing due", :attr:`~planaria.master.routes.Route.idle`)
  goes at once, as the agent acts on nothing in it.
- **Idempotent by sequence number.** ``seq`` counts up per client (``?client=ID`` in the URL,
  one per agent process). The master keeps each request's reply until the agent says it has it:
  ``open`` lists the requests whose replies the agent still waits for (this one included), and
  a reply kept for any other is forgotten. A request sent again, on a new connection after the
  old one dropped, gets the reply kept for its ``seq`` (or waits for the same answer) and is
  not served twice. ``{"cancel": N}`` gives a request up.
- **Notices.** A message without ``seq`` is a notice, ``{"op": PATH, "body": {...}}``: it wants
  no reply, and a route takes it only where the next one says it again (``/heartbeat``: the
  node's progress, and that it lives). Nothing is sent back for it (in a profile at 3,000
  agents, one socket write per heartbeat was a fifth of the master's time), but a refusal:
  ``{"re": null, "op": PATH, "status": S, "body": {...}}``. A 409 or 410 is not sent: the
  agent's standing ``/actions`` gets it too.

A message that is not of this form gets an error reply (``re`` null when its ``seq`` cannot be
read) and closes the channel with code 1008; the rest of the API is unaffected.

Why one module: a reply's journal write, its keeping by ``seq`` until the agent has it, and its
place in the outbox are one protocol whose rules lean on each other (a reply sent again is the
one kept; a reply kept is on disk); split, they would be read apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic_core
from aiohttp import WSCloseCode, WSMessage, WSMsgType, web
from pydantic import BaseModel

from planaria.background import Running
from planaria.log import get_logger
from planaria.master.body import validate
from planaria.master.guard import LIMITS, handler_left
from planaria.master.responses import BadRequest, error, refusal, refused
from planaria.master.routes import FENCED, REATTACH, Context, Route
from planaria.master.state import Deferred
from planaria.protocol import API_PREFIX, ApiError

log = get_logger("master")

PATH = f"{API_PREFIX}/channel"
CLIENT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a client id may be: an agent makes one (a random hex string) per process."""
KEPT_CLIENTS = 200_000
"""Clients whose unconfirmed replies are kept, the least recently heard from forgotten first:
every agent of the largest job, and every agent replaced during it."""
KEPT_REPLIES = 256
"""Unconfirmed replies kept per client: an agent has a few requests in flight at most."""
SAID_ELSEWHERE = (REATTACH, FENCED)
"""A notice refused for these is not answered: the agent's standing ``/actions`` is, with the
same status (re-attach first; fenced)."""
_CLOSED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)
"""What ``receive()`` gives once the channel is closing or closed."""
_NOT_OPEN: Any = object()
"""What :attr:`Channels.open` gives for a channel that is not open (any more)."""
SEND_SLICE = 0.2
"""Seconds of writes in a row before the loop gets a turn. A burst is what agents wait for (a
restart decided for every node, a round's ``ready``); what comes while it is sent is mostly what
it brings (the joins of the restart's round, which cannot close before the burst is out) or a
heartbeat, whose reply tells of nothing decided. At 10,000 agents a burst is about 0.1 s of
writes here, sent in one go; a larger one gives the loop a turn each slice."""
SEND_AT_ONCE = 1 << 15
"""A connection whose kernel buffer holds more than this many bytes gets its replies from a
task of its own, so that one slow reader cannot hold up the replies to the others."""


class _Asked:
    """One request of a client, by its ``seq``: its reply once there is one. While its answer
    is deferred it is the callback of the wait (called when the wait is done), so that a
    standing request costs one small object, not a closure and its cells."""

    __slots__ = ("channels", "deferred", "given_up", "reply", "route", "seq", "waiting")

    def __init__(self, seq: int) -> None:
        self.reply: str | None = None
        self.waiting: list[web.WebSocketResponse] = []
        """Connections that asked for it before it was answered."""
        self.given_up = False
        self.seq = seq
        self.deferred: Deferred[Any] | None = None
        self.route: Route | None = None
        self.channels: Channels | None = None

    def __call__(self, _: asyncio.Future[Any]) -> None:
        """The deferred answer's wait is done."""
        assert self.channels is not None and self.deferred is not None and self.route is not None
        channels, deferred, route = self.channels, self.deferred, self.route
        self.channels = self.deferred = self.route = None
        channels._answered(self, deferred, route)


class _Idle:
    """A reply that tells of nothing decided, sent at once (see ``After the journal``)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


class _Client:
    __slots__ = ("asked",)

    def __init__(self) -> None:
        self.asked: dict[int, _Asked] = {}

    def has(self, waiting: list[Any]) -> None:
        """The client waits for the replies of ``waiting`` only: every other reply kept for it
        arrived, and is forgotten. A request not answered yet is kept whatever the list says
        (its answer is still to be sent)."""
        if len(self.asked) > 1 or (self.asked and next(iter(self.asked)) not in waiting):
            for seq in [s for s, a in self.asked.items() if a.reply is not None]:
                if seq not in waiting:
                    del self.asked[seq]


class Channels:
    """The channel's state in one master: its clients' kept replies, its open connections and
    the outbox of its replies. Every reply goes through the outbox, sent by one task after one
    journal write for all those made meanwhile: a message costs no await of its own, and a
    restart decided for 10,000 nodes is 10,000 writes in a row."""

    def __init__(self, routes: Sequence[Route], context: Context) -> None:
        self.ops: Mapping[str, Route] = {r.path.removeprefix(API_PREFIX): r for r in routes}
        self.context = context
        self.clients: OrderedDict[str, _Client] = OrderedDict()
        self.open: dict[web.WebSocketResponse, asyncio.Transport | None] = {}
        """The open channels, and the transport each one is on."""
        self._outbox: list[tuple[web.WebSocketResponse, _Asked]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._tasks: Running[asyncio.Future[None]] = Running()
        self.stats = context.master.channel
        self._burst: tuple[float, str] | None = None
        """When the first reply of the burst of pushed replies now being sent was made, and
        its op."""

    def client(self, client_id: str) -> _Client:
        found = self.clients.get(client_id)
        if found is None:
            found = self.clients[client_id] = _Client()
            if len(self.clients) > KEPT_CLIENTS:
                self.clients.popitem(last=False)
        else:
            self.clients.move_to_end(client_id)
        return found

    async def serve(self, request: web.Request) -> web.StreamResponse:
        """Serve one agent's channel until it closes (no middleware frame stands beside it:
        its refusals before the upgrade are answered here as the API's)."""
        client_id = request.query.get("client", "")
        if not CLIENT.fullmatch(client_id):
            handler_left(request)  # the connection may carry another request: timed again
            return error(400, f"GET {PATH} needs ?client=ID (1 to 64 of A-Z a-z 0-9 _ . -)")
        ws = web.WebSocketResponse(
            max_msg_size=request.app[LIMITS].max_request_bytes, compress=False
        )
        try:
            await ws.prepare(request)
        except Exception as exc:  # not an upgrade to a WebSocket
            handler_left(request)
            return refused(request, exc)
        client = self.client(client_id)
        transport = request.transport
        self.open[ws] = transport if isinstance(transport, asyncio.Transport) else None
        self.stats.open = len(self.open)
        try:
            # Each message is handed on as it came, held by no name here while the next one
            # is awaited (its bytes, at 10,000 agents, are memory).
            while await self._take(ws, client, await ws.receive()):
                pass
        except Exception:  # a bug of the master's, not the agent's: said, and the agent retries
            log.exception("a channel failed; it is closed", client=client_id)
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"the master failed")
        finally:
            self.open.pop(ws, None)
            self.stats.open = len(self.open)
        return ws

    async def close_all(self) -> None:
        """Close every open channel (the master stops): agents reconnect to the next one."""
        for ws in list(self.open):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the master stops")

    async def _take(self, ws: web.WebSocketResponse, client: _Client, message: WSMessage) -> bool:
        """Serve one message; False when the channel closed, or the message was not one (the
        channel is closed then)."""
        if message.type is not WSMsgType.TEXT:
            if message.type in _CLOSED:
                return False
            await self._refuse(ws, None, "a channel message is a JSON text message")
            return False
        text: str = message.data
        try:
            envelope = pydantic_core.from_json(text, allow_inf_nan=False)
        except ValueError as exc:
            await self._refuse(ws, None, f"a channel message is a JSON object: {exc}")
            return False
        if not isinstance(envelope, dict):
            await self._refuse(ws, None, "a channel message is a JSON object")
            return False
        if "cancel" in envelope:
            seq = envelope["cancel"]
            asked = client.asked.get(seq) if type(seq) is int else None
            if asked is not None and asked.reply is None:
                asked.given_up = True
                del client.asked[seq]
            return True
        if "seq" not in envelope:
            return await self._notice(ws, envelope, text)
        seq, op, waiting = envelope.get("seq"), envelope.get("op"), envelope.get("open", [])
        if type(seq) is not int or type(op) is not str or type(waiting) is not list:
            await self._refuse(
                ws,
                seq if type(seq) is int else None,
                'a request is {"seq": integer, "op": string, "body": object, "open": [integer]}',
            )
            return False
        client.has(waiting)
        asked = client.asked.get(seq)
        if asked is not None:  # sent again (the connection it first came on dropped)
            asked.waiting.append(ws)
            if asked.reply is not None:
                self._post(asked)
            return True
        if len(client.asked) >= KEPT_REPLIES:
            why = f"over {KEPT_REPLIES} requests unanswered or unconfirmed (open)"
            await self._refuse(ws, seq, why)
            return False
        asked = client.asked[seq] = _Asked(seq)
        reply = self._call(op, envelope.get("body"), raw=text)
        if isinstance(reply, tuple):  # deferred: answered when its wait is done
            asked.deferred, asked.route = reply
            asked.channels = self
            asked.waiting.append(ws)
            asked.deferred.waiting.add_done_callback(asked)
            return True
        if inspect.isawaitable(reply):
            asked.waiting.append(ws)
            self._tasks.start(self._later(asked, reply))
            return True
        if isinstance(reply, _Idle):  # nothing decided: no journal write to wait for
            asked.reply = reply.text
            await self._send(ws, seq, reply.text)
            return True
        asked.reply = reply
        asked.waiting.append(ws)
        self._post(asked)
        return True

    async def _notice(self, ws: web.WebSocketResponse, envelope: dict[str, Any], raw: str) -> bool:
        """Take a notice: no reply, but a refusal the agent must hear of (one it would not
        learn from its standing ``/actions``)."""
        op = envelope.get("op")
        if type(op) is not str:
            await self._refuse(ws, None, 'a notice is {"op": string, "body": object}')
            return False
        route = self.ops.get(op)
        if route is None or not route.notice:
            why = f"the channel takes no notice {op!r}" + (" (send it with a seq)" if route else "")
            await self._tell(ws, op, _reply(404, ApiError(error=why)))
            return True
        assert route.request is not None
        try:
            answer = route.call(self.context, validate(envelope.get("body"), route.request, raw))
        except Exception as exc:
            status, refused = _refused(exc, route)
            if status not in SAID_ELSEWHERE:
                await self._tell(ws, op, refused)
            return True
        if inspect.isawaitable(answer):  # none wants it; it runs to its end all the same
            self._tasks.start(_awaited(answer, route))
        return True

    async def _tell(self, ws: web.WebSocketResponse, op: str, reply: str) -> None:
        # An agent that keeps sending a bad heartbeat would log a line a second, 10,000 agents
        # of a bad build 10,000: the first is logged, then one in a thousand, with the count.
        self.stats.notices_refused += 1
        refused = self.stats.notices_refused
        if refused == 1 or refused % 1000 == 0:
            log.warning("a notice refused", op=op, reply=reply[:200], refused=refused)
        await self._send(ws, None, f'"op":{json.dumps(op)},{reply}')

    def _call(
        self, op: str, body: Any, raw: str
    ) -> str | _Idle | tuple[Deferred[BaseModel], Route] | Any:
        """The reply to ``op`` with ``body`` as the message to send (``re`` left to fill;
        :class:`_Idle` when it tells of nothing decided), or an awaitable of it, or the route's
        deferred answer (and the route)."""
        route = self.ops.get(op)
        if route is None:
            return _reply(404, ApiError(error=f"the channel serves no {op!r}"))
        try:
            model = validate(body, route.request, raw) if route.request is not None else None
            answer = route.call(self.context, model)
        except Exception as exc:
            return _refused(exc, route)[1]
        if isinstance(answer, Deferred):
            return answer, route
        if inspect.isawaitable(answer):
            return _awaited(answer, route)
        text = _checked(answer, route)
        return _Idle(text) if route.idle is not None and route.idle(answer) else text

    def _answered(self, asked: _Asked, deferred: Deferred[BaseModel], route: Route) -> None:
        if asked.given_up:
            return
        try:
            asked.reply = _checked(deferred.then(), route)
        except Exception as exc:  # the answer could not be made: say so, do not hang
            asked.reply = _reply(500, ApiError(error=f"the master failed to answer: {exc!r}"))
        if self._burst is None:
            self._burst = asyncio.get_running_loop().time(), route.path.removeprefix(API_PREFIX)
        self._post(asked)

    async def _later(self, asked: _Asked, reply: Any) -> None:
        asked.reply = await reply
        self._post(asked)

    def _post(self, asked: _Asked) -> None:
        assert asked.reply is not None
        for ws in asked.waiting:
            self._outbox.append((ws, asked))
        asked.waiting.clear()
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """Send the outbox, in this one task: one journal write for all that came in at once
        (what its replies changed), then each reply. A long burst gives the loop a turn every
        :data:`SEND_SLICE` of writes, and what came meanwhile (a heartbeat's reply) goes out
        next, before the rest of the burst: no reply waits behind more than a slice of it."""
        queue: deque[tuple[web.WebSocketResponse, _Asked]] = deque()
        clock = asyncio.get_running_loop().time
        try:
            while self._outbox or queue:
                if self._outbox:
                    batch, self._outbox = self._outbox, []
                    try:
                        await self.context.master.journal_committed()
                    except Exception as exc:  # not on disk: no reply may say it was taken
                        failed = _reply(500, ApiError(error=f"the master's journal failed: {exc}"))
                        for _, asked in batch:
                            asked.reply = failed
                    queue.extendleft(reversed(batch))
                turn = clock() + SEND_SLICE
                while queue and clock() < turn:
                    ws, asked = queue.popleft()
                    reply = asked.reply
                    assert reply is not None
                    transport = self.open.get(ws, _NOT_OPEN)
                    if transport is _NOT_OPEN or ws.closed:
                        continue  # kept: the agent asks again on its next connection
                    if transport is not None and transport.get_write_buffer_size() > SEND_AT_ONCE:
                        self._tasks.start(self._send(ws, asked.seq, reply))  # holds up no one else
                        continue
                    # What _send does, written out (no coroutine of its own): this loop is the
                    # push, 10,000 replies at a restart. A connection that went meanwhile
                    # keeps its reply for the next one.
                    with contextlib.suppress(ConnectionError):
                        await ws.send_str(_addressed(asked.seq, reply))
                if queue:
                    await asyncio.sleep(0)
                elif self._burst is not None and not self._outbox:
                    began, op = self._burst
                    self.stats.last_push_s[op], self._burst = clock() - began, None
        finally:
            self._flushing = None

    async def _send(self, ws: web.WebSocketResponse, seq: int | None, reply: str) -> None:
        if ws.closed or ws not in self.open:
            return  # kept: the agent asks again on its next connection
        # The connection may go meanwhile: the reply is kept for the next one.
        with contextlib.suppress(ConnectionError):
            await ws.send_str(_addressed(seq, reply))

    async def _refuse(self, ws: web.WebSocketResponse, seq: int | None, why: str) -> None:
        log.warning("a channel message refused; the channel is closed", error=why)
        await self._send(ws, seq, _reply(400, ApiError(error=f"bad channel message: {why}")))
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=why[:120].encode())


def _reply(status: int, body: BaseModel | str) -> str:
    """A reply message but its ``re``: ``"status": S, "body": ...}``."""
    text = body if isinstance(body, str) else body.model_dump_json(exclude_defaults=status != 200)
    return f'"status":{status},"body":{text}}}'


def _addressed(seq: int | None, reply: str) -> str:
    return f'{{"re":{"null" if seq is None else seq},{reply}'


_LAST_ANSWER: list[tuple[BaseModel, str]] = []
"""The frozen answer written last, and its message (one slot)."""


def _checked(answer: Any, route: Route) -> str:
    if not isinstance(answer, route.reply):
        raise TypeError(f"{route.path} answered {type(answer).__name__}, not its reply")
    if _LAST_ANSWER and _LAST_ANSWER[0][0] is answer:  # a restart pushed to every node
        return _LAST_ANSWER[0][1]
    text = _reply(200, answer.model_dump_json())
    if answer.model_config.get("frozen"):
        _LAST_ANSWER[:] = [(answer, text)]
    return text


async def _awaited(answer: Any, route: Route) -> str:
    try:
        return _checked(await answer, route)
    except Exception as exc:
        return _refused(exc, route)[1]


def _refused(exc: Exception, route: Route) -> tuple[int, str]:
    """The status and reply of a request ``route`` refused with ``exc``."""
    response = exc.response if isinstance(exc, BadRequest) else refusal(exc, "POST", route.path)
    assert isinstance(response.body, bytes)
    return response.status, _reply(response.status, response.body.decode())
