"""What the master's API refuses: raw bytes in headers, slow or half-sent requests, a client
holding too many connections, and registrations of nodes the job never launched."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from planaria.master.server import ServerLimits
from planaria.protocol import API_PREFIX
from support.master import AUTH, TOKEN, with_master


def with_guarded_master(tmp_path: Path, body, limits: ServerLimits):
    async def on_port(master, session, url):
        await body(master, session, urlsplit(url).port)

    return with_master(tmp_path, on_port, limits)


def url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{API_PREFIX}{path}"


async def raw_exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), wait)
    finally:
        writer.close()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closed this connection within ``seconds``: an EOF, or a reset (a
    socket closed with bytes of ours still unread in it, as a busy server leaves it)."""
    try:
        return await asyncio.wait_for(reader.read(65536), seconds) == b""
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False


def test_a_header_that_is_not_latin_1_is_a_401_not_a_500(tmp_path):
    async def body(master, session, port):
        for value in (b"Bearer \xff\xfe\x80", "Bearer тест".encode(), b"\xc3\x28"):
            request = (
                b"GET " + API_PREFIX.encode() + b"/status HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: " + value + b"\r\nConnection: close\r\n\r\n"
            )
            reply = await raw_exchange(port, request)
            assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
            assert b"token" in reply
        async with session.get(url(port, "/status"), headers=AUTH) as r:
            assert r.status == 200

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits()))


def test_half_sent_requests_are_cut_off_and_others_are_still_served(tmp_path):
    async def body(master, session, port):
        limit = 1.0
        started = time.monotonic()
        held = []
        # Silent after connecting; a header cut short; a header sent one byte at a time.
        for first in (b"", b"POST " + API_PREFIX.encode() + b"/register HTTP/1.1\r\nHost: x"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(first)
            held.append((reader, writer))
        loris_reader, loris = await asyncio.open_connection("127.0.0.1", port)
        # A body that never ends: the header promises more bytes than come.
        header = (
            f"POST {API_PREFIX}/register HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            "Content-Length: 400\r\n\r\n{"
        ).encode()
        body_reader, body_writer = await asyncio.open_connection("127.0.0.1", port)
        body_writer.write(header)

        # Meanwhile a well-behaved client is answered at once.
        async with session.get(url(port, "/status"), headers=AUTH) as r:
            assert r.status == 200

        for byte in b"GET /v1/status HTTP/1.1\r\n":  # slower than the limit allows in all
            loris.write(bytes([byte]))
            await asyncio.sleep(limit / 10)
            if loris.is_closing() or loris_reader.at_eof():
                break
        for reader, _ in held:
            assert await closed_within(reader, 3 * limit)
        assert await closed_within(loris_reader, 3 * limit)
        reply = await asyncio.wait_for(body_reader.read(65536), 3 * limit)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"did not arrive within 1s" in reply
        assert time.monotonic() - started < 10 * limit
        for _, writer in [*held, (None, loris), (None, body_writer)]:
            writer.close()
        assert all(n.phase.value == "launched" for n in master.nodes.values())

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits(request_timeout=1.0)))


def test_one_client_cannot_hold_more_than_its_share_of_connections(tmp_path):
    async def body(master, session, port):
        cap = 20
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
        await asyncio.sleep(0.3)
        over = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        for reader, _ in over:  # refused at once: closed (or reset) by the master
            assert await closed_within(reader, 2)
        with pytest.raises(aiohttp.ClientError):  # this client is over its share too
            async with session.get(url(port, "/status"), headers=AUTH):
                pass
        for _, writer in [*held, *over]:
            writer.close()
        await asyncio.sleep(0.3)
        async with session.get(url(port, "/status"), headers=AUTH) as r:
            assert r.status == 200

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits(per_client=20)))


def test_only_launched_nodes_register_and_only_once(tmp_path):
    async def body(master, session, port):
        ghost = {"node_id": "node-77", "host": "evil", "addr": "127.0.0.1", "pid": 4242}
        async with session.post(url(port, "/register"), json=ghost, headers=AUTH) as r:
            assert r.status == 403
            assert "never launched" in (await r.json())["error"]
        assert "node-77" not in master.nodes

        first = {"node_id": "node-0", "host": "local-0", "addr": "127.0.0.1", "pid": 100}
        async with session.post(url(port, "/register"), json=first, headers=AUTH) as r:
            assert r.status == 200
        async with session.post(url(port, "/register"), json=first, headers=AUTH) as r:
            assert r.status == 200  # the same agent asking again: its reply was lost
        usurper = {**first, "pid": 101}
        async with session.post(url(port, "/register"), json=usurper, headers=AUTH) as r:
            assert r.status == 403
            assert "registered already" in (await r.json())["error"]
        assert master.nodes["node-0"].pid == 100

        master.fleet.launching += 1  # a launch in flight: an unknown id may still be coming
        try:
            async with session.post(url(port, "/register"), json=ghost, headers=AUTH) as r:
                assert r.status == 503
                assert (await r.json())["retry"] is True
        finally:
            master.fleet.launching -= 1

        events = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
        refused = [e for e in events if e["kind"] == "registration_refused"]
        assert [e["node"] for e in refused] == ["node-77", "node-0"]
        assert refused[1]["data"]["pid"] == 101
        assert not [f for f in master.faults if f.node == "node-77"]

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits()))


def http_reply(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case names) and JSON body of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    if headers.get("transfer-encoding") == "chunked":
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return int(status_line.split()[1]), headers, json.loads(body)


async def read_reply(reader: asyncio.StreamReader, wait: float = 5.0) -> bytes:
    """One whole response (its header, then Content-Length bytes of body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), wait)


LIMIT = 64 * 1024


def test_a_body_over_the_limit_is_a_413_saying_so_chunked_or_not(tmp_path):
    async def body(master, session, port):
        start = (
            f"POST {API_PREFIX}/register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\n"
        ).encode()
        # Announced too large: refused from the header alone, the body never read.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(start + b"Content-Length: 10000000\r\n\r\n" + b" " * 1000)
        status, headers, reply = http_reply(await read_reply(reader))
        writer.close()
        assert status == 413 and headers["content-type"].startswith("application/json")
        assert headers["connection"] == "close"
        assert reply == {
            "error": f"request body of 10000000 bytes is over the limit of {LIMIT} "
            "(master.max_request_bytes)"
        }

        # The connection is closed as the answer says, once the body's rest is read and
        # dropped (aiohttp's lingering close), not kept for a next request.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        over = LIMIT + 1
        writer.write(start + b"Content-Length: %d\r\n\r\n%s" % (over, b" " * over))
        status, headers, _ = http_reply(await read_reply(reader))
        assert status == 413 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()

        # Chunked, no Content-Length: refused once more than the limit came.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(start + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b" " * 4096
        for _ in range(2 * LIMIT // len(chunk)):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        status, _, reply = http_reply(await read_reply(reader))
        writer.close()
        assert status == 413
        assert reply["error"].startswith("request body of at least ")
        assert reply["error"].endswith(
            f"bytes is over the limit of {LIMIT} (master.max_request_bytes)"
        )

        # Compressed small, but over the limit once inflated: refused as well.
        bomb = gzip.compress(b" " * (4 * LIMIT))
        async with session.post(
            url(port, "/register"),
            data=bomb,
            headers={**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"},
        ) as r:
            assert r.status == 413, await r.text()
            assert "master.max_request_bytes" in (await r.json())["error"]

        # Just under the limit, chunked: served.
        reg = json.dumps({"node_id": "node-0", "host": "h", "addr": "127.0.0.1", "pid": 1})
        padded = reg.encode().ljust(LIMIT - 10)

        async def chunks():
            for i in range(0, len(padded), 5000):
                yield padded[i : i + 5000]

        async with session.post(url(port, "/register"), data=chunks(), headers=AUTH) as r:
            assert r.status == 200, await r.text()
        assert master.nodes["node-0"].phase.value == "registered"
        async with session.get(url(port, "/status"), headers=AUTH) as r:
            assert r.status == 200

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits(max_request_bytes=LIMIT)))


def test_the_public_probe_needs_no_token_and_nothing_else_is_public(tmp_path):
    async def body(master, session, port):
        base = f"http://127.0.0.1:{port}"
        async with session.get(f"{base}/healthz") as r:
            assert r.status == 200 and await r.json() == {"ok": True}
        async with session.post(f"{base}/healthz", json={}) as r:  # only the probe's GET
            assert r.status == 401
        for path in (f"{API_PREFIX}/status", f"{API_PREFIX}/nowhere", "/healthz/x", "/"):
            async with session.get(base + path) as r:
                assert r.status == 401, path
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
        # With the token, an unknown route or method is a JSON error too.
        async with session.get(f"{base}{API_PREFIX}/nowhere", headers=AUTH) as r:
            assert r.status == 404 and "error" in await r.json()
        async with session.get(url(port, "/register"), headers=AUTH) as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert "Method Not Allowed" in (await r.json())["error"]

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits()))


NOT_AS_THE_SCHEMA_SAYS = [
    (b'{"node_id": "node-0", "addr": "a", "port": 1.5}', "port:"),
    (b'{"node_id": "node-0", "addr": "a", "port": "80"}', "port:"),
    (b'{"node_id": "node-0", "addr": "a", "port": true}', "port:"),
    (b'{"node_id": "node-0", "addr": "a", "port": 80, "last_step": 1e999}', "<body>:"),
    (b'{"node_id": "node-0", "addr": "a", "port": NaN}', "<body>:"),
    (b"[" * 10000, "<body>:"),
    (b"\xff\xfe", "<body>:"),
]


def test_bodies_are_read_as_their_schema_says_and_nothing_looser(tmp_path):
    async def run(master, session, port):
        reg = {"node_id": "node-0", "host": "h", "addr": "127.0.0.1", "pid": 1}
        async with session.post(url(port, "/register"), json=reg, headers=AUTH) as r:
            assert r.status == 200
        for body, problem in NOT_AS_THE_SCHEMA_SAYS:
            async with session.post(url(port, "/rendezvous/join"), data=body, headers=AUTH) as r:
                assert r.status == 400, (body, await r.text())
                reply = await r.json()
                assert reply["error"] == "invalid JoinRequest"
                assert reply["problems"][0].startswith(problem), reply
        assert master.nodes["node-0"].phase.value == "registered"
        # A whole number is an integer however it is written, as in JSON Schema.
        beat = {"node_id": "node-0", "round": 0.0, "activity": "idle", "wait": False}
        async with session.post(url(port, "/heartbeat"), json=beat, headers=AUTH) as r:
            assert r.status == 200, await r.text()
        # A number too large for a float is no infinity in a float field either (the body
        # that a plain validation would take as it parsed).
        for huge in (
            b"1e999",
            b"-1.5E+400",
            b"9" * 400 + b".0",
            b"1" + b"0" * 250 + b"e99",
            b"9" * 299 + b".5e10",
        ):
            beat_bytes = (
                b'{"node_id":"node-0","round":0,"activity":"idle","wait":false,'
                b'"first_step_time":' + huge + b"}"
            )
            async with session.post(url(port, "/heartbeat"), data=beat_bytes, headers=AUTH) as r:
                assert r.status == 400, (huge, await r.text())
                assert (await r.json())["problems"][0].startswith("<body>:")

    asyncio.run(with_guarded_master(tmp_path, run, ServerLimits()))


def test_a_channel_refused_before_its_upgrade_leaves_its_connection_timed(tmp_path):
    """A GET of the channel answered without an upgrade (no token, no client id, not a
    WebSocket) leaves its keep-alive connection under the header time limit, as any answered
    request does: a header that never ends on it is cut off."""

    async def body(master, session, port):
        limit = 1.0
        auth = f"Authorization: Bearer {TOKEN}\r\n"
        for query, headers, status in (
            ("?client=a", "", b"401"),
            ("", auth, b"400"),
            ("?client=a", auth, b"400"),
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = f"GET {API_PREFIX}/channel{query} HTTP/1.1\r\nHost: x\r\n{headers}\r\n"
            writer.write(request.encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.split()[1] == status, head
            size = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(size), 5)
            writer.write(f"GET {API_PREFIX}/status HTTP/1.1\r\nHost".encode())  # never ends
            assert await closed_within(reader, 3 * limit), f"held after {status.decode()}"
            writer.close()

    asyncio.run(with_guarded_master(tmp_path, body, ServerLimits(request_timeout=1.0)))
