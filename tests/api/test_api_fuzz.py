"""Every route of the master's API, fuzzed with schemathesis against a live master: generated
from the same OpenAPI document ``planaria api-schema`` prints, valid and invalid bodies alike.

Each case must get no 5xx, a reply that conforms to its documented schema and status, and 401
when it is sent without the token or with a wrong one (the public probe answers either way).
The master still answers a status request at the end. Deterministic: a fixed seed and
derandomized generation, the same cases on every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from planaria import leftovers
from planaria.master import openapi
from planaria.master.binding import prover
from planaria.master.job import Master
from planaria.master.routes import ROUTES
from planaria.master.runner import supervise
from planaria.master.server import ServerLimits, make_app, serve
from planaria.process import processes
from planaria.protocol import API_PREFIX
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler
from support.master import TOKEN, settings

AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = ("node-0", "node-1")
EXAMPLES = 25
MARK = f"fuzzed-master-node-of-{os.getpid()}"
"""On the stand-in nodes' command lines: none may be left running after the fuzz."""

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 13,
        "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
        # A valid request of a node the fuzz got declared lost (a health report replaces it)
        # is answered 410, fenced: documented, and no rejection of valid data.
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "3xx", "401", "403", "404", "409", "410", "429"]
            }
        },
    }
)
schema = schemathesis.openapi.from_dict(openapi.document(), config=CONFIG)


class LiveMaster:
    """A master and its HTTP server on loopback, in an event loop of their own thread, since
    schemathesis calls it synchronously. Its nodes are stand-in processes that never call back:
    the fuzz plays the agents, and both nodes are registered first so that bodies naming them
    reach past the unknown-node check."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.url = ""
        self.master: Master | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="live-master", daemon=True)

    def __enter__(self) -> LiveMaster:
        self._thread.start()
        assert self._ready.wait(30), "the master did not start"
        if self._error is not None:
            raise self._error
        for node in NODES:
            reg = {"node_id": node, "host": node, "addr": "127.0.0.1", "pid": os.getpid()}
            reply = requests.post(f"{self.url}{API_PREFIX}/register", json=reg, headers=AUTH)
            assert reply.status_code == 200, reply.text
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._done is not None
        self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the master did not stop"
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        master = self.master = Master(
            settings(self.run_dir), LocalScheduler(LocalOptions()), self.run_dir
        )
        # Long polls hold for a moment only: a fuzz case that waits for a round or an action
        # gets its answer in 50 ms.
        app = make_app(
            master,
            TOKEN,
            hold=0.05,
            join_hold=0.05,
            limits=ServerLimits(request_timeout=5.0),
            binding=prover(TOKEN, "ab" * 32),  # /v1/bind answers as over TLS
        )
        runner, port = await serve(app, "127.0.0.1", 0)
        # The stand-ins serve every case of this module: they carry no test's marker (the
        # per-test leftovers check), and the module checks by MARK that none outlives it.
        idle = LaunchSpec(
            job="api",
            command=(sys.executable, "-c", "import time; time.sleep(120)", MARK),
            env={leftovers.VARIABLE: ""},
        )
        job = asyncio.ensure_future(supervise(master, idle))
        try:
            while len(master.nodes) < len(NODES):  # launched: registrations are accepted
                await asyncio.sleep(0.05)
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
            await self._done.wait()
        finally:
            master.stop("fuzz over")
            await asyncio.wait_for(job, 30)
            await runner.cleanup()
            master.timeline.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveMaster]:
    with LiveMaster(tmp_path_factory.mktemp("fuzz")) as live:
        yield live
        # No crash: after every case the master still serves.
        reply = requests.get(f"{live.url}{API_PREFIX}/status", headers=AUTH, timeout=10)
        assert reply.status_code == 200, reply.text
    assert not _running(MARK), "stand-in node processes left running"


def _running(mark: str) -> list[int]:
    """Processes (not zombies) whose command line holds ``mark``."""
    found = []
    for pid, _ in processes():
        with contextlib.suppress(OSError):
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _steer(case: schemathesis.Case) -> None:
    """Half of the bodies that name a node name a registered one (chosen by the body's hash,
    so the same on every run): random names would all stop at the unknown-node 404."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("node_id"), str):
        digest = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())
        if digest % 2 == 0:
            case.body = {**body, "node_id": NODES[digest // 2 % len(NODES)]}


def _without_token(case: schemathesis.Case, base_url: str, token: str | None) -> Any:
    kwargs = case.as_transport_kwargs(base_url=base_url)
    headers = {k: v for k, v in kwargs.pop("headers", {}).items() if k.lower() != "authorization"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.request(**kwargs, headers=headers, timeout=30)


@schema.parametrize()
def test_every_route_survives_the_fuzz(case: schemathesis.Case, live: LiveMaster) -> None:
    _steer(case)
    public = any(r.public and (r.method, r.path) == (case.method, case.path) for r in ROUTES)
    # Not served without the token, nor with a wrong one: 401 before the body is even read.
    for token in (None, "wrong-" + TOKEN):
        refused = _without_token(case, live.url, token)
        if public:
            # Served on its merits: a body that does not validate is a 400, never a 401.
            assert refused.status_code in (200, 400), refused.text
        else:
            assert refused.status_code == 401, (case.method, case.path, refused.text)
            assert "token" in refused.json()["error"]
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    # With the token: no 5xx, status, content type, headers and body as documented. A chaos
    # rule's kind decides which of its fields it needs, and a duration must be over 0 ("0ms"
    # matches its pattern), rules its JSON Schema does not spell out: a rule that breaks them
    # is refused with 400 naming the rule, and only that.
    excluded = [positive_data_acceptance] if case.path == f"{API_PREFIX}/chaos" else []
    reply = case.call_and_validate(
        base_url=live.url, headers=AUTH, excluded_checks=excluded, timeout=30
    )
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if excluded and positive and reply.status_code == 400:
        problems = reply.json()["problems"]
        assert problems and all(p.startswith(("rule: ", "rule.")) for p in problems), problems


def test_every_route_of_the_table_is_fuzzed() -> None:
    operations = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert operations == {(r.method, r.path) for r in ROUTES}
