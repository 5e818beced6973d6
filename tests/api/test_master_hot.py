"""The heartbeat's lean path (:mod:`planaria.master.wire`): a heartbeat that comes whole on a
kept-alive connection is read and answered without aiohttp's request machinery. These tests
send real requests over real sockets and hold its answers to aiohttp's own, byte for byte,
for good requests and bad ones alike."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from planaria.agent.client import MasterClient
from planaria.master.body import may_overflow
from planaria.master.job import Master
from planaria.master.runner import supervise
from planaria.master.server import BOOK, ServerLimits, make_app, serve
from planaria.master.state import NodePhase
from planaria.master.tls import job_certificate, server_context
from planaria.master.wire import Framer, whole_request
from planaria.protocol import API_PREFIX, Heartbeat, HeartbeatReply, RegisterReply, RegisterRequest
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler
from support.master import TOKEN, settings

IDLE = LaunchSpec(job="api", command=(sys.executable, "-c", "import time; time.sleep(60)"))


async def until(predicate, what: str, timeout: float = 30) -> None:
    """Wait for ``predicate()`` (slow on a busy machine); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        await asyncio.sleep(0.02)


async def with_hot_master(tmp_path: Path, body, limits=None, hold: float = 0.2, tls=False):
    """A master whose nodes never call back; ``body(master, book, port)`` plays the agents."""
    master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
    app = make_app(master, TOKEN, hold=hold, limits=limits)
    context = server_context(job_certificate(tmp_path, ["127.0.0.1"])) if tls else None
    runner, port = await serve(app, "127.0.0.1", 0, context)
    job = asyncio.ensure_future(supervise(master, IDLE))
    try:
        await until(lambda: "node-0" in master.nodes, "the idle node launched")
        assert app[BOOK].hot is not None, "the lean path is off with this aiohttp"
        if not tls:
            conn = await Connection.open(port)
            assert (await conn.exchange(REGISTER)).startswith(b"HTTP/1.1 200")
            conn.close()
        await body(master, app[BOOK], port)
    finally:
        master.stop("test over")
        await asyncio.wait_for(job, 30)
        await runner.cleanup()
        master.timeline.close()


def request(
    path: str, body: bytes, token: str | None = TOKEN, fields: bytes = b"", method: bytes = b"POST"
) -> bytes:
    auth = b"" if token is None else b"Authorization: Bearer %s\r\n" % token.encode()
    return (
        b"%s %s HTTP/1.1\r\nHost: master\r\n%sContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s"
        % (method, (API_PREFIX + path).encode(), auth, fields, len(body), body)
    )


def beat(node: str = "node-0", wait: bool = False, **more: object) -> bytes:
    body = {"node_id": node, "round": 0, "activity": "idle", "wait": wait, **more}
    return json.dumps(body).encode()


REGISTER = request("/register", b'{"node_id":"node-0","host":"h","addr":"127.0.0.1","pid":1}')
WARM = b"GET %s/status HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer %s\r\n\r\n" % (
    API_PREFIX.encode(),
    TOKEN.encode(),
)
"""A first request on a connection, served by aiohttp (its handler then waits for the next)."""


class Connection:
    """One kept-alive client connection that reads each response whole."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def response(self, timeout: float = 5.0) -> bytes:
        """The next response, its Date field taken out (the one part that may differ)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        found = re.search(rb"\r\nContent-Length: (\d+)\r\n", head)
        assert found is not None, head
        body = await asyncio.wait_for(self.reader.readexactly(int(found.group(1))), timeout)
        return re.sub(rb"\r\nDate: [^\r]*", b"", head) + body

    async def exchange(self, data: bytes) -> bytes:
        self.writer.write(data)
        return await self.response()

    async def closed(self) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), 3) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        self.writer.close()


async def both_ways(book, port: int, data: bytes) -> tuple[bytes, bytes]:
    """``data``'s answer with the lean path on and with it off (aiohttp serves everything),
    each on a kept-alive connection of its own that served a request first."""
    answers = []
    for lean in (True, False):
        conn = await Connection.open(port)
        saved = book.hot
        try:
            assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
            if not lean:
                book.hot = None
            answers.append(await conn.exchange(data))
        finally:
            book.hot = saved
            conn.close()
    return answers[0], answers[1]


GOOD = [
    ("a beat", request("/heartbeat", beat()), 200),
    ("a long poll", request("/heartbeat", beat(wait=True)), 200),
    ("3.0 for 3", request("/heartbeat", beat().replace(b'"round": 0', b'"round": 0.0')), 200),
    ("an unknown node", request("/heartbeat", beat("ghost")), 404),
    (
        "field names in lower case",
        b"POST /v1/heartbeat HTTP/1.1\r\nhost: m\r\nauthorization:  Bearer %s \r\n"
        b"content-length: %d\r\n\r\n%s" % (TOKEN.encode(), len(beat()), beat()),
        200,
    ),
]
REFUSED = [
    ("no token", request("/heartbeat", beat(), token=None), 401),
    ("a wrong token", request("/heartbeat", beat(), token="wrong"), 401),
    (
        "the token without Bearer",
        request("/heartbeat", beat(), token="").replace(b"Bearer ", TOKEN.encode()),
        401,
    ),
    ("not JSON", request("/heartbeat", b"{not json"), 400),
    (
        "a string for a number",
        request("/heartbeat", beat().replace(b'"round": 0', b'"round": "0"')),
        400,
    ),
    ("an unknown field", request("/heartbeat", beat(extra=1)), 400),
    (
        "a number out of range",
        request("/heartbeat", beat(round=0).replace(b'"round": 0', b'"round": 1e999')),
        400,
    ),
    ("a GET", request("/heartbeat", b"", method=b"GET"), 405),
    ("a query", request("/heartbeat?x=1", beat()), 200),
    (
        "a chunked body",
        request("/heartbeat", b"").replace(
            b"Content-Length: 0\r\n\r\n",
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(beat()), beat()),
        ),
        200,
    ),
    (
        "two Authorization fields",
        request("/heartbeat", beat(), fields=b"Authorization: x\r\n"),
        200,
    ),
]


@pytest.mark.parametrize(
    ("case", "data", "status"), GOOD + REFUSED, ids=[c[0] for c in GOOD + REFUSED]
)
def test_a_heartbeat_is_answered_as_aiohttp_answers_it(tmp_path, case, data, status):
    """What the lean path serves it answers as aiohttp does; what it must not serve (a bad
    token, a bad body, anything out of the plain form) it leaves to aiohttp, untouched."""

    async def body(master, book, port):
        before = book.hot.taken
        lean, plain = await both_ways(book, port, data)
        assert lean.startswith(b"HTTP/1.1 %d " % status), lean[:300]
        assert lean == plain
        assert book.hot.taken - before == (1 if (case, data, status) in GOOD else 0)

    asyncio.run(with_hot_master(tmp_path, body))


def join(node: str) -> bytes:
    body = {"node_id": node, "addr": "127.0.0.1", "port": 40000 + int(node.rsplit("-", 1)[1])}
    return request("/rendezvous/join", json.dumps(body).encode())


def test_a_join_is_held_and_answered_by_the_lean_path_as_aiohttp_answers_it(tmp_path):
    """A round's joins come from every node at once: the lean path holds one until the round
    closes (here when the other node joins through aiohttp), and answers a join as aiohttp
    does."""

    async def body(master, book, port):
        first, second = await Connection.open(port), await Connection.open(port)
        register = b'{"node_id":"node-1","host":"h1","addr":"127.0.0.1","pid":2}'
        try:
            assert (await first.exchange(WARM)).startswith(b"HTTP/1.1 200")
            assert (await second.exchange(request("/register", register))).startswith(
                b"HTTP/1.1 200"
            )
            before = book.hot.taken
            first.writer.write(join("node-0"))  # held: the round waits for node-1
            await asyncio.sleep(0.3)
            assert book.hot.taken == before + 1 and master.nodes["node-0"].phase.value == "joined"
            saved, book.hot = book.hot, None
            try:
                plain = await second.exchange(join("node-1"))
            finally:
                book.hot = saved
            lean = await first.response()
        finally:
            first.close()
            second.close()
        infos = []
        for answer in (lean, plain):
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]
            reply = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert reply["state"] == "ready", reply
            infos.append(reply["info"])
        assert sorted(i["node_rank"] for i in infos) == [0, 1]
        assert infos[0]["round"] == infos[1]["round"] == master.round
        # The round closed: a join again is ready at once, the same bytes either way.
        before = book.hot.taken
        again_lean, again_plain = await both_ways(book, port, join("node-0"))
        assert again_lean == again_plain and b'"state":"ready"' in again_lean
        assert book.hot.taken == before + 1

    asyncio.run(with_hot_master(tmp_path, body))


@pytest.mark.parametrize("phase", ["lost", "not attached"])
def test_a_fenced_or_unattached_node_gets_410_or_409_from_the_lean_path(tmp_path, phase):
    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
        node = master.nodes["node-0"]
        if phase == "lost":
            node.phase = NodePhase.LOST
        else:
            node.attached = False
        before = book.hot.taken
        lean = await conn.exchange(request("/heartbeat", beat()))
        assert book.hot.taken == before + 1
        saved, book.hot = book.hot, None
        try:
            plain = await conn.exchange(request("/heartbeat", beat()))
        finally:
            book.hot = saved
        assert lean == plain
        assert lean.startswith(b"HTTP/1.1 410 Gone" if phase == "lost" else b"HTTP/1.1 409")
        conn.close()

    asyncio.run(with_hot_master(tmp_path, body))


def test_a_body_over_the_limit_is_413_from_aiohttp(tmp_path):
    async def body(master, book, port):
        lean, plain = await both_ways(book, port, request("/heartbeat", beat(activity="x" * 300)))
        assert lean.startswith(b"HTTP/1.1 413"), lean[:200]
        assert b"over the limit of 300" in lean
        assert lean == plain
        assert book.hot.taken == 0

    asyncio.run(with_hot_master(tmp_path, body, ServerLimits(max_request_bytes=300)))


def test_connection_close_is_left_to_aiohttp_and_honoured(tmp_path):
    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
        answer = await conn.exchange(request("/heartbeat", beat(), fields=b"Connection: close\r\n"))
        assert answer.startswith(b"HTTP/1.1 200")
        assert await conn.closed()
        assert book.hot.taken == 0
        conn.close()

    asyncio.run(with_hot_master(tmp_path, body))


def test_requests_behind_a_held_heartbeat_are_answered_after_it_in_order(tmp_path):
    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        conn.writer.write(request("/heartbeat", beat(wait=True)))
        await asyncio.sleep(0.05)  # held by now
        status = b"GET /v1/status HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer %s\r\n\r\n"
        conn.writer.write(status % TOKEN.encode())
        conn.writer.write(request("/heartbeat", beat()))
        first = await conn.response()
        held = time.monotonic() - started
        second, third = await conn.response(), await conn.response()
        assert b'"action":{"kind":"none"' in first
        assert held >= 0.15  # the long poll was held (0.2 s)
        assert second.startswith(b"HTTP/1.1 200") and b'"job":"api"' in second
        assert third.startswith(b"HTTP/1.1 200") and b'"action"' in third
        # What came during the hold is read after it, all at once: two requests, for aiohttp.
        assert book.hot.taken == 1
        # Two requests in one write: aiohttp serves both, in order.
        two = request("/heartbeat", beat()) + request("/heartbeat", beat("ghost"))
        conn.writer.write(two)
        assert (await conn.response()).startswith(b"HTTP/1.1 200")
        assert (await conn.response()).startswith(b"HTTP/1.1 404")
        assert book.hot.taken == 1
        assert (await conn.exchange(request("/heartbeat", beat()))).startswith(b"HTTP/1.1 200")
        assert book.hot.taken == 2
        conn.close()

    asyncio.run(with_hot_master(tmp_path, body))


def test_after_a_request_in_pieces_the_lean_path_takes_the_next_one_whole(tmp_path):
    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
        data = request("/heartbeat", beat())
        cut = data.index(b"\r\n\r\n") + 10
        conn.writer.write(data[:cut])  # the head and part of the body, then the rest
        await asyncio.sleep(0.1)
        conn.writer.write(data[cut:])
        assert (await conn.response()).startswith(b"HTTP/1.1 200")
        assert book.hot.taken == 0
        assert (await conn.exchange(data)).startswith(b"HTTP/1.1 200")
        assert book.hot.taken == 1
        conn.close()

    asyncio.run(with_hot_master(tmp_path, body))


def test_after_a_chunked_request_aiohttp_keeps_the_connection(tmp_path):
    """A chunked body cannot be followed by the lean path: it stays off for that
    connection, which aiohttp goes on serving."""

    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
        chunked = request("/heartbeat", b"").replace(
            b"Content-Length: 0\r\n\r\n",
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(beat()), beat()),
        )
        assert (await conn.exchange(chunked)).startswith(b"HTTP/1.1 200")
        for _ in range(3):
            assert (await conn.exchange(request("/heartbeat", beat()))).startswith(b"HTTP/1.1 200")
        assert book.hot.taken == 0
        other = await Connection.open(port)
        assert (await other.exchange(WARM)).startswith(b"HTTP/1.1 200")
        assert (await other.exchange(request("/heartbeat", beat()))).startswith(b"HTTP/1.1 200")
        assert book.hot.taken == 1
        conn.close()
        other.close()

    asyncio.run(with_hot_master(tmp_path, body))


def test_a_held_heartbeat_is_answered_before_the_server_shuts_down(tmp_path):
    """As aiohttp does for its own requests: its shutdown waits for a held long poll."""

    async def run():
        master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
        app = make_app(master, TOKEN, hold=1.0)
        runner, port = await serve(app, "127.0.0.1", 0)
        job = asyncio.ensure_future(supervise(master, IDLE))
        closing = None
        try:
            await until(lambda: "node-0" in master.nodes, "the idle node launched")
            conn = await Connection.open(port)
            assert (await conn.exchange(REGISTER)).startswith(b"HTTP/1.1 200")
            conn.writer.write(request("/heartbeat", beat(wait=True)))
            await until(lambda: app[BOOK].hot.taken == 1, "the heartbeat taken by the lean path")
            closing = asyncio.ensure_future(runner.cleanup())
            answer = await conn.response()
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            await asyncio.wait_for(closing, 10)
            assert await conn.closed()
            conn.close()
        finally:
            master.stop("test over")
            await asyncio.wait_for(job, 30)
            if closing is None:
                await runner.cleanup()
            master.timeline.close()

    asyncio.run(run())


def test_the_idle_timer_counts_from_the_last_heartbeat(tmp_path, monkeypatch):
    """aiohttp closes a connection idle for its keep-alive time; heartbeats served by the
    lean path count as traffic, as aiohttp's own requests do."""
    monkeypatch.setattr(web, "AppRunner", functools.partial(web.AppRunner, keepalive_timeout=0.5))

    async def body(master, book, port):
        conn = await Connection.open(port)
        assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")  # starts the timer
        for _ in range(8):  # 1.6 s of heartbeats
            assert (await conn.exchange(request("/heartbeat", beat()))).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.2)
        assert book.hot.taken == 8
        assert not conn.reader.at_eof()
        assert await conn.closed()  # once they stop, idle: closed

    asyncio.run(with_hot_master(tmp_path, body))


def test_an_agent_over_tls_beats_through_the_lean_path(tmp_path):
    async def body(master, book, port):
        certificate = job_certificate(tmp_path, ["127.0.0.1"])
        client = MasterClient(
            f"https://127.0.0.1:{port}", TOKEN, fingerprint=certificate.fingerprint
        )
        try:
            register = RegisterRequest(node_id="node-0", host="h", addr="127.0.0.1", pid=1)
            await client.call("/register", register, RegisterReply)
            for wait in (False, True):
                heartbeat = Heartbeat(node_id="node-0", round=0, activity="idle", wait=wait)
                reply = await client.call("/heartbeat", heartbeat, HeartbeatReply)
                assert reply.action.kind == "none"
        finally:
            await client.close()
        assert book.hot.taken == 2

    asyncio.run(with_hot_master(tmp_path, body, tls=True))


@pytest.mark.parametrize(
    "data",
    [
        b"POST /v1/heartbeat HTTP/1.1\r\nHost: m\r\n folded\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/heartbeat HTTP/1.1\nHost: m\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}",
        b"POST /v1/heartbeat HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"POST /v1/heartbeat HTTP/1.1\r\nHost : m\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 3\r\n\r\n{}",
        b"\r\nPOST /v1/heartbeat HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    ],
)
def test_the_reader_takes_nothing_out_of_the_plain_form(data):
    assert whole_request(data) is None
    framer = Framer()
    framer.feed(data)
    assert not framer.between


def test_the_framer_follows_requests_in_any_pieces():
    one = b"POST /v1/x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    two = b"GET /v1/status HTTP/1.1\r\nHost: m\r\n\r\n"
    data = one + two + one
    for size in (1, 2, 7, len(data)):
        framer = Framer()
        for at in range(0, len(data), size):
            framer.feed(data[at : at + size])
            ends = {len(one), len(one + two), len(data)}
            assert framer.between == (min(at + size, len(data)) in ends)
    assert whole_request(one) is not None
    assert whole_request(one + two) is None  # two requests: not one whole one


def test_a_journal_that_fails_gets_no_heartbeat_an_ok(tmp_path):
    """What a request changed is on disk before it is answered: when the journal cannot be
    written, the lean path answers 500 and closes the connection, as aiohttp does."""

    async def body(master, book, port):
        def broken() -> asyncio.Future[None]:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(OSError("disk full"))
            return failed

        answers = []
        for lean in (True, False):
            conn = await Connection.open(port)
            assert (await conn.exchange(WARM)).startswith(b"HTTP/1.1 200")
            saved = book.hot
            master.journal_commit = broken
            if not lean:
                book.hot = None
            try:
                answers.append(await conn.exchange(request("/heartbeat", beat())))
                assert await conn.closed()
            finally:
                book.hot = saved
                del master.journal_commit
                conn.close()
        assert book.hot.taken == 1
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 500"), answer[:200]
            assert b"Connection: close" in answer
            assert answer.endswith(b"500 Internal Server Error\n\nServer got itself in trouble")

    asyncio.run(with_hot_master(tmp_path, body))


@given(st.binary().map(lambda b: bytes(b"0123456789.eE+-a"[x % 16] for x in b)))
def test_the_overflow_check_finds_what_its_pattern_does(raw):
    """A body is walked for numbers out of range exactly when one may be in it."""
    pattern = re.compile(rb"[0-9.][eE][+-]?[0-9]{3}|[0-9]{200}")
    assert may_overflow(raw) == (pattern.search(raw) is not None)
    assert may_overflow(b"1" * 200) and may_overflow(b'{"a": 1.5e308}')
    assert not may_overflow(b'{"name": "e308"}')
