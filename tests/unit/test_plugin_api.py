"""The plugin author's side: one public module, one way to build a plugin from a spec, and the
agent's one client to the master (the join included) riding out a short master outage."""

from __future__ import annotations

import asyncio
import importlib
import json
import socket

import pytest
from aiohttp import web

import planaria.plugin
from planaria.agent.client import MasterClient
from planaria.errors import PluginError, PluginNotFoundError, PluginOptionsError
from planaria.plugin.kinds import RECORD_TYPES
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind, PluginRecord
from planaria.protocol import API_PREFIX, JoinReply, JoinRequest, RendezvousInfo
from planaria.storage.local import LocalStorage


def test_every_public_name_resolves_to_its_kinds_module():
    for name in planaria.plugin.__all__:
        value = getattr(planaria.plugin, name)
        assert value is not None, name
    for module, names in planaria.plugin._HOME.items():  # the table the module reads
        for name in names:
            assert getattr(planaria.plugin, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = planaria.plugin.Nope  # type: ignore[attr-defined]


def test_every_kind_has_a_record_type_in_its_own_api_module():
    assert set(RECORD_TYPES) == set(PluginKind)
    for kind, record in RECORD_TYPES.items():
        assert record.__module__ == f"planaria.{_package(kind)}.api", kind
        if issubclass(record, PluginRecord):
            assert record.kind is kind
            assert getattr(planaria.plugin, record.__name__) is record


def _package(kind: PluginKind) -> str:
    return {
        PluginKind.HEALTH_CHECK: "health",
        PluginKind.CHECKPOINT_STORAGE: "storage",
    }.get(kind, kind.value)


def test_build_makes_the_plugin_the_spec_selects(tmp_path):
    manager = PluginManager.from_entry_points()
    spec = {"backend": "local", "options": {"path": str(tmp_path)}}
    storage = manager.build(PluginKind.CHECKPOINT_STORAGE, spec, path="checkpoint.storage")
    assert isinstance(storage, LocalStorage)
    storage.write("a/b", [b"xyz"])
    assert storage.read("a/b") == b"xyz"


def test_bad_options_name_every_problem_under_the_config_path(tmp_path):
    manager = PluginManager.from_entry_points()
    spec = {"backend": "local", "options": {"pth": "x", "fsync": "sometimes"}}
    with pytest.raises(PluginOptionsError) as caught:
        manager.build(PluginKind.CHECKPOINT_STORAGE, spec, path="checkpoint.storage")
    paths = [issue.path for issue in caught.value.issues]
    assert "checkpoint.storage.options.pth" in paths
    assert "checkpoint.storage.options.fsync" in paths  # every problem, not the first
    assert "unknown key" in str(caught.value) and "path" in str(caught.value)
    with pytest.raises(PluginNotFoundError, match="Choose one of: local"):
        manager.build(PluginKind.CHECKPOINT_STORAGE, {"backend": "s4"}, path="checkpoint.storage")
    with pytest.raises(PluginOptionsError, match=r"expected \{backend: NAME"):
        manager.build(PluginKind.CHECKPOINT_STORAGE, ["local"], path="checkpoint.storage")  # type: ignore[arg-type]


def test_a_spec_from_the_master_loads_its_one_plugin_and_honours_disable(tmp_path):
    spec = {"backend": "local", "options": {"path": str(tmp_path)}, "plugin": "local_storage"}
    manager = PluginManager.for_spec(spec)
    assert list(manager.plugins) == ["local_storage"]  # nothing else imported
    manager.build(PluginKind.CHECKPOINT_STORAGE, spec, path="checkpoint.storage")
    blocked = PluginManager.for_spec(spec, disable=["local_storage"])
    with pytest.raises(PluginError, match=r"disabled by plugins\.disable"):
        blocked.build(PluginKind.CHECKPOINT_STORAGE, spec, path="checkpoint.storage")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_join_rides_out_a_short_master_outage():
    """The master is down when the agent asks to join and comes up 1.5 s later: the join
    (through the agent's one client) retries and gets its round, as heartbeats do."""
    port = _free_port()
    info = RendezvousInfo(
        round=1,
        node_rank=0,
        num_nodes=1,
        rank_offset=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=1,
    )
    seen: list[JoinRequest] = []

    async def channel(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            asked = json.loads(message.data)
            assert asked["op"] == "/rendezvous/join"
            seen.append(JoinRequest.model_validate(asked["body"]))
            reply = JoinReply(state="ready", info=info).model_dump(mode="json")
            await ws.send_str(json.dumps({"re": asked["seq"], "status": 200, "body": reply}))
        return ws

    async def scenario() -> JoinReply:
        app = web.Application()
        app.router.add_get(f"{API_PREFIX}/channel", channel)
        runner = web.AppRunner(app)
        await runner.setup()

        async def come_up_later() -> None:
            await asyncio.sleep(1.5)
            await web.TCPSite(runner, "127.0.0.1", port).start()

        client = MasterClient(f"http://127.0.0.1:{port}", "token", give_up_after=15)
        later = asyncio.ensure_future(come_up_later())
        try:
            body = JoinRequest(node_id="node-0", addr="127.0.0.1", port=2)
            return await client.call("/rendezvous/join", body, JoinReply)
        finally:
            await later
            await client.close()
            await runner.cleanup()

    reply = asyncio.run(scenario())
    assert reply.state == "ready" and reply.info == info
    assert reply.directives.restart_count == 0 and reply.directives.restore == "storage"
    assert [r.node_id for r in seen] == ["node-0"]


def test_a_plugin_tests_its_option_errors_with_the_public_api_alone():
    """``ConfigError`` (and its ``ConfigIssue``s) come from ``planaria.plugin``, and
    ``planaria.testing.validate_options`` reads a plugin's options as a config file's are."""
    from pydantic import BaseModel, ConfigDict, model_validator

    import planaria.testing
    from planaria.plugin import (
        CheckContext,
        ConfigError,
        ConfigIssue,
        DeviceResult,
        HealthCheck,
        HealthCheckRecord,
    )

    class ChipOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        max_temp: int = 80
        warm_temp: int = 70

        @model_validator(mode="after")
        def _ordered(self) -> ChipOptions:
            if self.warm_temp > self.max_temp:
                raise ValueError(f"warm_temp ({self.warm_temp}) must not exceed max_temp")
            return self

    class Chip(HealthCheck[ChipOptions]):
        def run(self) -> list[DeviceResult]:
            return []

    record = HealthCheckRecord(name="chip", factory=Chip, options=ChipOptions, summary="a chip")
    assert {"ConfigError", "ConfigIssue"} <= set(planaria.plugin.__all__)
    assert {"ConfigError", "validate_options"} <= set(planaria.testing.__all__)
    assert planaria.testing.ConfigError is ConfigError
    at = "diagnosis.checks[0].options"
    with pytest.raises(ConfigError) as caught:
        planaria.testing.validate_options(record, {"max_temp": "hot", "max_tmp": 1}, path=at)
    assert [issue.path for issue in caught.value.issues] == [f"{at}.max_temp", f"{at}.max_tmp"]
    assert all(isinstance(issue, ConfigIssue) for issue in caught.value.issues)
    assert "unknown key; ChipOptions takes: max_temp, warm_temp" in str(caught.value)
    with pytest.raises(ConfigError, match=r"options: warm_temp \(90\) must not exceed max_temp"):
        planaria.testing.validate_options(record, {"warm_temp": 90})
    options = planaria.testing.validate_options(record, {"max_temp": 90})
    assert Chip(options, CheckContext(node="n", workdir=".")).options.max_temp == 90
