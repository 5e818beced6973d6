"""Launchers started outside planaria: how an agent that holds only the shared token learns
the master's certificate (channel binding, against a real TLS master and a real server in the
middle), how the master admits the nodes it never launched, and how a launcher reads its line."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from planaria.agent.client import MasterClient, MasterRejected
from planaria.cli.rendezvous import (
    DEFAULT_PORT,
    LauncherError,
    local_address,
    node_id,
    parse_endpoint,
)
from planaria.master.binding import BindingRefused, learn_fingerprint, prover, wait_for_master
from planaria.master.job import Master
from planaria.master.runner import supervise
from planaria.master.server import make_app, serve
from planaria.master.tls import job_certificate, pinning_context, server_context
from planaria.protocol import API_PREFIX, RegisterReply, RegisterRequest
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.external import ExternalOptions, ExternalScheduler
from support.master import settings

TOKEN = "bind-test-token-0123456789"


async def with_bound_master(tmp_path, body, nodes: int = 2) -> None:
    """A master of nodes started outside (none started here) serving TLS on loopback with
    ``POST /v1/bind``; ``body(port, fingerprint)`` plays the launchers."""
    certificate = job_certificate(tmp_path / "master", ["127.0.0.1"])
    scheduler = ExternalScheduler(ExternalOptions())
    master = Master(settings(tmp_path, nodes=nodes), scheduler, tmp_path)
    app = make_app(master, TOKEN, hold=0.2, binding=prover(TOKEN, certificate.fingerprint))
    runner, port = await serve(app, "127.0.0.1", 0, server_context(certificate))
    job_ = asyncio.ensure_future(supervise(master, LaunchSpec(job="api", command=("true",))))
    try:
        await body(port, certificate.fingerprint)
    finally:
        master.stop("test over")
        await asyncio.wait_for(job_, 30)
        await runner.cleanup()
        master.timeline.close()


@pytest.fixture
def master_dir(tmp_path):
    (tmp_path / "master").mkdir()
    return tmp_path


def test_the_token_s_holder_learns_the_certificate_and_another_token_is_refused(master_dir):
    async def body(port, fingerprint):
        learnt = await asyncio.to_thread(learn_fingerprint, "127.0.0.1", port, TOKEN)
        assert learnt == fingerprint
        with pytest.raises(BindingRefused) as refused:
            await asyncio.to_thread(learn_fingerprint, "127.0.0.1", port, "another-token-0000")
        assert "does not hold this launcher's token (PLANARIA_TOKEN)" in str(refused.value)

    asyncio.run(with_bound_master(master_dir, body))


def test_a_server_in_the_middle_that_relays_the_proof_is_refused(master_dir):
    """It shows a certificate of its own and passes the nonce on to the real master: the
    proof it relays covers the real master's certificate, not the one the agent saw."""

    async def body(port, fingerprint):
        pin = aiohttp.Fingerprint(bytes.fromhex(fingerprint))

        async def relay(request: web.Request) -> web.Response:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"https://127.0.0.1:{port}{API_PREFIX}/bind",
                    data=await request.read(),
                    headers={"Content-Type": "application/json"},
                    ssl=pin,
                ) as reply,
            ):
                return web.Response(body=await reply.read(), status=reply.status)

        app = web.Application()
        app.router.add_post(f"{API_PREFIX}/bind", relay)
        other = job_certificate(master_dir / "middle", ["127.0.0.1"])
        runner, middle = await serve_plain_app(app, server_context(other))
        try:
            with pytest.raises(BindingRefused, match="does not hold this launcher's token"):
                await asyncio.to_thread(learn_fingerprint, "127.0.0.1", middle, TOKEN)
        finally:
            await runner.cleanup()

    (master_dir / "middle").mkdir()
    asyncio.run(with_bound_master(master_dir, body))


async def serve_plain_app(app: web.Application, context) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    return runner, runner.addresses[0][1]


def test_no_master_yet_is_tried_again_until_the_timeout(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens there
    said = []
    started = time.monotonic()
    with pytest.raises(BindingRefused, match=r"no planaria master answered .* within 2s"):
        wait_for_master("127.0.0.1", port, TOKEN, 2.0, said.append)
    assert 1.0 <= time.monotonic() - started < 10
    assert len(said) == 1  # told once, not at every try


def test_nodes_started_outside_are_admitted_up_to_the_job_s_size(master_dir):
    async def body(port, fingerprint):
        url = f"https://127.0.0.1:{port}"
        client = MasterClient(url, TOKEN, fingerprint=fingerprint)
        try:
            for n in (1, 2):
                request = RegisterRequest(
                    node_id=f"node-{n}", host=f"h{n}", addr="127.0.0.1", pid=n
                )
                reply = await client.call("/register", request, RegisterReply)
                assert reply.spec.job == "api"
            third = RegisterRequest(node_id="node-3", host="h3", addr="127.0.0.1", pid=3)
            with pytest.raises(MasterRejected, match=r"403.*has its 2 node\(s\) already"):
                await client.call("/register", third, RegisterReply)
        finally:
            await client.close()
        # The same node started again while its earlier agent counts: it asks again later.
        again = RegisterRequest(node_id="node-1", host="h1", addr="127.0.0.1", pid=99)
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
            session.post(
                f"{url}{API_PREFIX}/register", data=again.model_dump_json(), ssl=pinning_context()
            ) as reply,
        ):
            answer = await reply.json()
            assert reply.status == 503 and answer["retry"], answer
            assert "once that one is declared lost" in answer["error"]
        # Without the token, the agent cannot register, whatever it learnt.
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{url}{API_PREFIX}/register",
                data=RegisterRequest(node_id="x", host="h", addr="a", pid=1).model_dump_json(),
                ssl=pinning_context(),
            ) as reply,
        ):
            assert reply.status == 401

    asyncio.run(with_bound_master(master_dir, body))


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("head:29500", "head", 29500),
        ("head", "head", DEFAULT_PORT),
        ("10.1.2.3:1", "10.1.2.3", 1),
        ("[fe80::1]:7", "fe80::1", 7),
    ],
)
def test_an_endpoint_is_read_as_torchrun_reads_it(text, host, port):
    endpoint = parse_endpoint(text)
    assert (endpoint.host, endpoint.port) == (host, port)


@pytest.mark.parametrize("text", ["", "h:0", "h:70000", "a:b:c", "h:x"])
def test_a_bad_endpoint_is_named(text):
    with pytest.raises(LauncherError, match="--rdzv-endpoint"):
        parse_endpoint(text)


def test_the_master_is_the_launcher_whose_machine_holds_the_endpoint():
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("192.0.2.1") is None  # TEST-NET-1: nobody's interface
    with pytest.raises(LauncherError, match="cannot resolve"):
        local_address("no-such-host.invalid")


def test_a_node_s_id_is_its_rank_or_its_address():
    assert node_id(3, "10.0.0.1") == "node-3"
    assert node_id(None, "10.0.0.1") == "node-10.0.0.1"
    assert node_id(None, "fe80::1%eth0") == "node-fe80-0000-0000-0000-0000-0000-0000-0001"
