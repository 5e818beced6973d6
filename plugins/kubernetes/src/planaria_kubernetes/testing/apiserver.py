"""The emulated API server: kmock's Kubernetes scaffold with an object store of its own.

:class:`ApiServer` is a :class:`kmock.KubernetesScaffold`: kmock provides the HTTP server, the
discovery documents (``/api``, ``/api/v1``, ``/apis``, ``/version``) and the plumbing of requests.
The core ``v1`` resources of :data:`KINDS` are served by :class:`Store` instead of kmock's
``KubernetesEmulator`` object array, whose semantics (no uid nor resourceVersion, dict-merge
patches, watches that always replay the current objects) are too far from a real server's for a
client that resumes watches.

The store, and what of the real server's semantics it keeps, is :mod:`.store`; its errors
are :mod:`.apierrors`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp.web
import attrs
import kmock

from planaria_kubernetes.testing import semantics
from planaria_kubernetes.testing.apierrors import ApiError
from planaria_kubernetes.testing.semantics import Obj
from planaria_kubernetes.testing.store import KINDS, Kind, Store, Watcher

__all__ = ["KINDS", "ApiError", "ApiServer", "Kind", "Store", "route"]


_PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?/?$"
)


@dataclass(frozen=True)
class Route:
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None


def route(path: str) -> Route | None:
    """Which core ``v1`` resource a path addresses, if one of :data:`KINDS`."""
    match = _PATH.match(path)
    if match is None:
        return None
    ns, plural, name, sub = match["ns"], match["plural"], match["name"], match["sub"]
    if plural not in KINDS and ns is not None and name is None:
        # /api/v1/namespaces/{name}/{subresource}
        ns, plural, name, sub = None, "namespaces", ns, plural
    if plural not in KINDS:
        return None
    return Route(plural, ns, name, sub)


def _int_param(params: Mapping[str, str], key: str) -> int | None:
    value = params.get(key)
    if value in (None, ""):
        return None
    try:
        return int(str(value))
    except ValueError as exc:
        raise ApiError(400, "BadRequest", f"invalid value for {key}: {value!r}") from exc


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """kmock's Kubernetes scaffold serving the core resources from a :class:`Store`."""

    store: Store = attrs.field(factory=Store)
    log: list[tuple[str, str]] = attrs.field(factory=list)
    bookmark_interval: float = 5.0
    pod_logs: Path | None = None  # where the kubelet writes <namespace>.<pod>.log

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in KINDS.values():
            self.resources[f"v1/{kind.plural}"] = kmock.ResourceInfo(
                namespaced=kind.namespaced,
                kind=kind.kind,
                singular=kind.kind.lower(),
                verbs={
                    "create",
                    "delete",
                    "deletecollection",
                    "get",
                    "list",
                    "patch",
                    "update",
                    "watch",
                },
                subresources={"status"} if kind.has_status else set(),
            )

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self.log.append((request.method.value, request.url.path_qs))
        # kmock's discovery, also under the paths with a trailing slash the client asks for.
        discovery = {
            "/version": self._serve_server_version,
            "/api": self._serve_api,
            "/api/v1": self._serve_version,
            "/apis": self._serve_apis,
        }.get(request.url.path.rstrip("/"))
        if discovery is not None and request.method.value == "GET":
            return aiohttp.web.json_response(await discovery(request))
        where = route(request.url.path)
        if where is None:
            return await super()._handle(request)
        try:
            return await self._serve(request, where)
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)
        except Exception as exc:
            self.store.report(f"{request.method.value} {request.url.path_qs}")
            error = ApiError(500, "InternalError", f"an error on the server ({exc!r})")
            return aiohttp.web.json_response(error.status(), status=500)

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0-emulated",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2024-08-13T00:00:00Z",
            "goVersion": "go1.22.5",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    async def _serve_api(self, request: kmock.Request) -> kmock.Payload:
        # kmock's lacks serverAddressByClientCIDRs, which the client's model requires.
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.raw_authority}
            ],
        }

    async def _serve(self, request: kmock.Request, where: Route) -> aiohttp.web.StreamResponse:
        store = self.store
        kind = KINDS[where.plural]
        params = request.params
        method = request.method.value
        resource = where.plural + (f"/{where.subresource}" if where.subresource else "")
        if (where.plural, where.subresource, method) == ("pods", "log", "GET"):
            assert where.name is not None
            store.check("get", resource, where.namespace, where.name)
            return self._serve_log(where.namespace, where.name, params)
        if where.subresource not in (None, "status") or (
            where.subresource == "status" and not kind.has_status
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if where.namespace is not None and not kind.namespaced:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns = where.namespace if kind.namespaced else None

        def reply(obj: Obj, code: int = 200) -> aiohttp.web.StreamResponse:
            return aiohttp.web.json_response(obj, status=code)

        if method == "GET" and where.name is None:
            try:
                labels = semantics.parse_label_selector(params.get("labelSelector"))
                fields = semantics.parse_field_selector(params.get("fieldSelector"))
            except semantics.SelectorError as exc:
                raise ApiError(400, "BadRequest", str(exc)) from exc
            if params.get("watch") in ("true", "1", "True"):
                store.check("watch", resource, ns, None)
                return await self._watch(request, Watcher(where.plural, ns, labels, fields))
            store.check("list", resource, ns, None)
            return reply(store.list_objects(where.plural, ns, labels, fields))
        if method == "GET" and params.get("watch") in ("true", "1", "True"):
            assert where.name is not None  # the deprecated watch of one object by its path
            store.check("watch", resource, ns, where.name)
            one = [semantics.FieldRequirement("metadata.name", where.name, False)]
            return await self._watch(request, Watcher(where.plural, ns, [], one))
        if method == "GET":
            assert where.name is not None
            store.check("get", resource, ns, where.name)
            return reply(store.get(where.plural, ns, where.name))
        if method == "POST" and where.name is None:
            store.check("create", resource, ns, None)
            return reply(store.create(where.plural, ns, request.data), 201)
        if method == "PUT" and where.name is not None:
            store.check("update", resource, ns, where.name)
            return reply(
                store.update(
                    where.plural, ns, where.name, request.data, subresource=where.subresource
                )
            )
        if method == "PATCH" and where.name is not None:
            store.check("patch", resource, ns, where.name)
            content_type = request.headers.get("Content-Type", "")
            try:
                data = json.loads(request.body or b"null")
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid JSON in the patch: {exc}") from exc
            return reply(
                store.patch(
                    where.plural, ns, where.name, content_type, data, subresource=where.subresource
                )
            )
        if method == "DELETE":
            body = request.data if isinstance(request.data, dict) else {}
            grace = _int_param(params, "gracePeriodSeconds")
            if body.get("gracePeriodSeconds") is not None:
                grace = int(body["gracePeriodSeconds"])
            if where.name is None:
                store.check("deletecollection", resource, ns, None)
                labels = semantics.parse_label_selector(params.get("labelSelector"))
                fields = semantics.parse_field_selector(params.get("fieldSelector"))
                items = store.list_objects(where.plural, ns, labels, fields)
                for item in items["items"]:
                    meta = item["metadata"]
                    with contextlib.suppress(ApiError):
                        store.delete(where.plural, meta.get("namespace"), meta["name"], grace)
                return reply(items)
            store.check("delete", resource, ns, where.name)
            obj = store.delete(
                where.plural, ns, where.name, grace, body.get("preconditions") or None
            )
            if where.plural == "pods":
                return reply(obj)
            return reply(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {
                        "name": where.name,
                        "kind": where.plural,
                        "uid": obj["metadata"]["uid"],
                    },
                }
            )
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")

    def _serve_log(
        self, namespace: str | None, name: str, params: Mapping[str, str]
    ) -> aiohttp.web.StreamResponse:
        """``pods/{name}/log``: what the pod's processes wrote (no ``follow``)."""
        pod = self.store.get("pods", namespace, name)
        path = self.pod_logs / f"{namespace}.{name}.log" if self.pod_logs else None
        if path is None or not path.exists() or pod["status"].get("phase") == "Pending":
            container = pod["spec"]["containers"][0]["name"]
            raise ApiError(
                400,
                "BadRequest",
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating',
            )
        text = path.read_text(errors="replace")
        tail = _int_param(params, "tailLines")
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:]) if tail > 0 else ""
        return aiohttp.web.Response(text=text, content_type="text/plain")

    async def _watch(self, request: kmock.Request, watcher: Watcher) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        params = request.params
        timeout = _int_param(params, "timeoutSeconds")
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1", "True")
        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": "application/json"}
        )
        await response.prepare(raw)
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        last_write = loop.time()

        async def send(event: Obj) -> None:
            nonlocal last_write
            await response.write(json.dumps(event).encode() + b"\n")
            last_write = loop.time()

        try:
            try:
                initial = store.subscribe(watcher, params.get("resourceVersion"))
            except ApiError as exc:
                await send({"type": "ERROR", "object": exc.status()})
                return response
            for event in initial:
                await send(event)
            while True:
                wait = 1.0
                if deadline is not None:
                    wait = min(wait, deadline - loop.time())
                    if wait <= 0:
                        break
                try:
                    change = await asyncio.wait_for(watcher.queue.get(), wait)
                except asyncio.TimeoutError:
                    if raw.transport is None or raw.transport.is_closing():
                        break
                    idle = loop.time() - last_write
                    if bookmarks and idle >= self.bookmark_interval and watcher.queue.empty():
                        await send(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": KINDS[watcher.plural].kind,
                                    "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(store.rv)},
                                },
                            }
                        )
                    continue
                if change is None:
                    break
                seen = watcher.event(change)
                if seen is not None:
                    await send(copy.deepcopy(seen))
        except (ConnectionError, RuntimeError):
            return response  # the client went away
        except Exception as exc:
            self.store.report(f"watch {request.url.path_qs}")
            error = ApiError(500, "InternalError", f"an error on the server ({exc!r})")
            with contextlib.suppress(ConnectionError, RuntimeError):
                await send({"type": "ERROR", "object": error.status()})
            return response
        finally:
            store.watchers.discard(watcher)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response
