"""The master API's OpenAPI document: written from the route table, committed, printed by
``planaria api-schema``, and true to what the server serves."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import jsonschema
import pytest
from pydantic import BaseModel

from planaria.master import openapi
from planaria.master.job import Master
from planaria.master.routes import ROUTES, Route
from planaria.master.server import make_app, serve
from planaria.protocol import API_PREFIX
from planaria.scheduler.local import LocalOptions, LocalScheduler
from support.master import AUTH, TOKEN, settings

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "api" / "openapi.json"


def planaria(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "core"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "planaria", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_committed_document_is_current():
    assert COMMITTED.read_text() == openapi.dumps(), (
        "docs/api/openapi.json is stale: run `planaria api-schema -o docs/api/openapi.json`"
    )


def test_api_schema_prints_the_document_or_writes_it(tmp_path):
    printed = planaria("api-schema", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == openapi.dumps()
    written = planaria("api-schema", "--output", "api.json", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "api.json").read_text() == openapi.dumps()
    refused = planaria("api-schema", "-o", str(tmp_path / "no" / "such" / "dir.json"), cwd=tmp_path)
    assert refused.returncode == 2
    assert "cannot write the API schema to" in refused.stderr and "dir.json" in refused.stderr


def test_every_route_is_documented_with_its_body_reply_errors_and_token():
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    assert doc["security"] == [{"jobToken": []}]
    assert doc["components"]["securitySchemes"]["jobToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The job's token, given to the agents it launches.",
    }
    operations = [(path, m) for path, item in doc["paths"].items() for m in item]
    assert len(operations) == len(ROUTES)
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["summary"] == route.summary
        ok = op["responses"]["200"]["content"][route.media_type]["schema"]["$ref"]
        assert ok == f"#/components/schemas/{route.reply.__name__}"
        statuses = {int(s) for s in op["responses"]} - {200}
        if route.public:
            assert op["security"] == [] and 401 not in statuses
        elif route.public_with is not None:  # the token, or none with the option on
            assert op["security"] == [{"jobToken": []}, {}] and 401 in statuses
            assert route.public_with in route.summary
        else:
            assert "security" not in op and 401 in statuses
        if route.request is None:
            assert "requestBody" not in op
        else:
            body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert body == f"#/components/schemas/{route.request.__name__}"
            assert {400, 408, 413} <= statuses
        for status in statuses:
            ref = op["responses"][str(status)]["$ref"].rsplit("/", 1)[1]
            assert ref in doc["components"]["responses"]
    bad = doc["components"]["responses"]["InvalidRequest"]["content"]["application/json"]
    problems = doc["components"]["schemas"]["InvalidRequest"]
    assert bad["schema"]["$ref"].endswith("/InvalidRequest")
    assert set(problems["required"]) == {"error", "problems"}


def test_every_schema_is_valid_json_schema_and_every_reference_resolves():
    doc = openapi.document()
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    text = json.dumps(doc)
    for name in doc["components"]["schemas"]:
        assert f'"#/components/schemas/{name}"' in text, f"{name} is never used"
    for ref in {part.split('"')[0] for part in text.split('"$ref": "')[1:]}:
        node = doc
        for key in ref.removeprefix("#/").split("/"):
            node = node[key]


class Echo(BaseModel):
    text: str


def test_a_new_route_is_one_row_served_and_documented(tmp_path):
    echo = Route(
        "POST",
        f"{API_PREFIX}/echo",
        Echo,
        Echo,
        "Say it back",
        lambda c, body: Echo(text=body.text * 2),
    )
    routes = (*ROUTES, echo)
    doc = openapi.document(routes)
    assert doc["paths"][f"{API_PREFIX}/echo"]["post"]["operationId"] == "post_echo"
    assert "Echo" in doc["components"]["schemas"]

    async def main() -> None:
        master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
        runner, port = await serve(make_app(master, TOKEN, 0.1, routes=routes), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}{API_PREFIX}/echo"
                async with session.post(url, json={"text": "ab"}, headers=AUTH) as r:
                    assert r.status == 200 and await r.json() == {"text": "abab"}
                async with session.post(url, json={"text": "ab"}) as r:
                    assert r.status == 401
                async with session.post(url, json={"text": 1}, headers=AUTH) as r:
                    assert r.status == 400
                    assert (await r.json())["problems"][0].startswith("text:")
        finally:
            await runner.cleanup()
            master.timeline.close()

    asyncio.run(main())


def test_a_reply_of_the_wrong_model_is_a_json_500_not_a_lie(tmp_path):
    wrong = Route(
        "GET", f"{API_PREFIX}/wrong", None, Echo, "Broken", lambda c, _: c.master.status()
    )

    async def main() -> None:
        master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
        app = make_app(master, TOKEN, 0.1, routes=(*ROUTES, wrong))
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}{API_PREFIX}/wrong"
                async with session.get(url, headers=AUTH) as r:
                    assert r.status == 500
                    assert "answered JobStatus, not its Echo" in (await r.json())["error"]
        finally:
            await runner.cleanup()
            master.timeline.close()

    asyncio.run(main())


@pytest.mark.parametrize("value", [512, "1MiB"])
def test_max_request_bytes_is_checked_in_the_config(tmp_path, value):
    from pydantic import ValidationError

    from planaria.config.models import MasterSection

    assert MasterSection().max_request_bytes == 1 << 20
    assert MasterSection(max_request_bytes=4096).max_request_bytes == 4096
    with pytest.raises(ValidationError, match="max_request_bytes"):
        MasterSection(max_request_bytes=value)
