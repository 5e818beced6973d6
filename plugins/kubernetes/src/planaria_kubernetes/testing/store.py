"""The emulated cluster's objects: :class:`Store` keeps them as the real API server does.

What :class:`Store` does like the real server:

* metadata on create (``uid``, one global ``resourceVersion`` counter, ``creationTimestamp``,
  ``generateName``, the URL's namespace), ``409 AlreadyExists``, ``404 NotFound``,
  ``422 Invalid`` (bad names, a pod without containers), ``409 Conflict`` on a stale
  ``resourceVersion`` in an update;
* lists filtered by ``labelSelector`` / ``fieldSelector``, ``kind: PodList`` etc. with the
  current ``resourceVersion``; a list's own ``resourceVersion`` parameter is ignored (the current
  state is always served, as the real server does for the default ``NotOlderThan`` semantics);
* watches from a ``resourceVersion`` replay the kept history of changes after it, then stream
  live ones; with no version (or ``"0"``) they start with ``ADDED`` for every current object;
  ``timeoutSeconds`` ends the stream; selectors apply, and a change that makes an object stop
  (start) matching is sent as ``DELETED`` (``ADDED``); ``allowWatchBookmarks`` gets a
  ``BOOKMARK`` after 5 s of silence; a version older than the kept history, or at or before the
  point :meth:`Store.expire_watches` set, gets the real server's ``410 Expired`` ``ERROR`` event
  in a 200 stream, which then ends;
* ``PUT`` replaces, ``PATCH`` is RFC 7386 merge patch (for both ``merge-patch+json`` and
  ``strategic-merge-patch+json``: lists are replaced, never merged by key) or RFC 6902 JSON
  patch; the ``status`` subresource changes only ``status``, the main resource never does;
* ``DELETE`` of a pod bound to a node and not terminal sets ``deletionTimestamp`` (now + grace)
  and ``deletionGracePeriodSeconds``; the kubelet removes it after stopping its processes. Other
  objects go at once. Removing an object deletes its dependents (``ownerReferences``), at once
  rather than in the background, once all their owners are gone; ``propagationPolicy`` is
  ignored. ``preconditions`` (uid, resourceVersion) are checked (409 Conflict). Deleting a
  namespace deletes what it holds and the namespace at once;
* ``pods/{name}/log`` serves what the pod's processes wrote (``tailLines``; no ``follow``);
* a (verb, resource) pair in :attr:`Store.forbidden` gets the real ``403 Forbidden``.

Everything runs in the server's event loop thread: :class:`Store` methods are synchronous, so
each one is atomic with respect to the watches and to the scheduler and kubelet, which call them
directly (the same code paths as the HTTP handlers).

Why one module: every operation of the store reads and writes the same objects, their history
of changes and the open watches; each method keeps one of the real server's rules about them,
and the rules read best together (a delete's grace period beside the watch event it sends).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import logging
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from planaria_kubernetes.testing import semantics
from planaria_kubernetes.testing.apierrors import ApiError, expired, invalid, not_found
from planaria_kubernetes.testing.semantics import Obj

USER = "system:serviceaccount:planaria:default"
LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kind:
    plural: str
    kind: str
    namespaced: bool
    has_status: bool


KINDS: dict[str, Kind] = {
    kind.plural: kind
    for kind in (
        Kind("pods", "Pod", True, True),
        Kind("secrets", "Secret", True, False),
        Kind("configmaps", "ConfigMap", True, False),
        Kind("events", "Event", True, False),
        Kind("serviceaccounts", "ServiceAccount", True, False),
        Kind("nodes", "Node", False, True),
        Kind("namespaces", "Namespace", False, True),
    )
}


def _fold_string_data(secret: Obj) -> None:
    """A Secret's write-only ``stringData`` goes base64-encoded into ``data``."""
    string_data = secret.pop("stringData", None) or {}
    if string_data:
        data = secret.get("data") or {}
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        secret["data"] = data


def _qos_class(spec: Obj) -> str:
    """Guaranteed (every container's cpu and memory limited, requests equal to the limits),
    BestEffort (nothing requested nor limited) or Burstable."""
    requested = False
    guaranteed = True
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}
        requested = requested or bool(requests)
        for name in ("cpu", "memory"):
            if name not in limits or str(requests.get(name)) != str(limits[name]):
                guaranteed = False
    if not requested:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


@dataclass
class Change:
    """One change of one object, as kept in the history and sent to the watches."""

    rv: int
    plural: str
    type: str  # ADDED, MODIFIED, DELETED
    old: Obj | None
    new: Obj


@dataclass(eq=False)
class Watcher:
    plural: str
    namespace: str | None
    labels: list[semantics.Requirement]
    fields: list[semantics.FieldRequirement]
    queue: asyncio.Queue[Change | None] = field(default_factory=asyncio.Queue)

    def selects(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return semantics.labels_match(self.labels, meta.get("labels")) and semantics.fields_match(
            self.fields, obj
        )

    def event(self, change: Change) -> Obj | None:
        """The event this watch sees for a change, if any (selectors applied)."""
        if change.plural != self.plural:
            return None
        before = self.selects(change.old)
        after = change.type != "DELETED" and self.selects(change.new)
        if after:
            kind = "MODIFIED" if before else "ADDED"
        elif before:
            kind = "DELETED"
        else:
            return None
        return {"type": kind, "object": change.new}


class Store:
    """The objects of the emulated cluster, their history of changes, and the open watches."""

    def __init__(self, history: int = 10000) -> None:
        self.rv = 0
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {plural: {} for plural in KINDS}
        self.history: deque[Change] = deque()
        self.history_size = history
        self.floor = 0  # changes at or before this version are no longer kept
        self.expired = 0  # resuming from a version at or before this one gets 410
        self.watchers: set[Watcher] = set()
        self.listeners: list[asyncio.Event] = []  # set on every change (scheduler, kubelet)
        self.forbidden: set[tuple[str, str]] = set()
        self.errors: list[str] = []  # tracebacks of the emulation's own failures

    def report(self, where: str) -> None:
        """Keep (and log) the exception being handled: a failure of the emulation itself."""
        LOG.exception("emulated cluster: %s failed", where)
        self.errors.append(f"{where}: {traceback.format_exc()}")

    # -- reading ------------------------------------------------------------------------------

    def find(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        obj = self.objects[plural].get((namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def get(self, plural: str, namespace: str | None, name: str) -> Obj:
        obj = self.find(plural, namespace, name)
        if obj is None:
            raise not_found(plural, name)
        return obj

    def all(self, plural: str) -> list[Obj]:
        """Every object of a resource (copies), sorted by namespace and name."""
        return [copy.deepcopy(obj) for _, obj in sorted(self.objects[plural].items())]

    def list_objects(
        self,
        plural: str,
        namespace: str | None,
        labels: list[semantics.Requirement],
        fields: list[semantics.FieldRequirement],
    ) -> Obj:
        watcher = Watcher(plural, namespace, labels, fields)
        items = [obj for obj in self.all(plural) if watcher.selects(obj)]
        return {
            "kind": f"{KINDS[plural].kind}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }

    # -- changing -----------------------------------------------------------------------------

    def _commit(self, plural: str, kind: str, old: Obj | None, new: Obj) -> Obj:
        self.rv += 1
        new = copy.deepcopy(new)
        new.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        meta = new["metadata"]
        key = (meta.get("namespace") or "", meta["name"])
        if kind == "DELETED":
            self.objects[plural].pop(key, None)
        else:
            self.objects[plural][key] = new
        change = Change(self.rv, plural, kind, old, new)
        self.history.append(change)
        while len(self.history) > self.history_size:
            self.floor = self.history.popleft().rv
        for watcher in self.watchers:
            watcher.queue.put_nowait(change)
        for listener in self.listeners:
            listener.set()
        return copy.deepcopy(new)

    def create(self, plural: str, namespace: str | None, body: Any) -> Obj:
        kind = KINDS[plural]
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
        obj: Obj = copy.deepcopy(body)
        meta: Obj = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if kind.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on"
                    " the request",
                )
            namespace = namespace or meta.get("namespace")
            if not namespace:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
            if ("", namespace) not in self.objects["namespaces"]:
                raise not_found("namespaces", namespace)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = str(meta["generateName"]) + semantics.random_suffix()
            else:
                raise invalid(
                    kind.kind,
                    "",
                    "metadata.name",
                    "FieldValueRequired",
                    "Required value: name or generateName is required",
                )
        name = str(meta["name"])
        if not semantics.DNS1123_SUBDOMAIN.match(name) or len(name) > 253:
            raise invalid(
                kind.kind,
                name,
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": {semantics.DNS1123_SUBDOMAIN_ERROR}',
            )
        if (meta.get("namespace") or "", name) in self.objects[plural]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{plural} "{name}" already exists',
                {"name": name, "kind": plural},
            )
        self._validate(kind, obj)
        obj["apiVersion"] = "v1"
        obj["kind"] = kind.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = semantics.timestamp()
        meta.pop("deletionTimestamp", None)
        meta.pop("deletionGracePeriodSeconds", None)
        meta.pop("resourceVersion", None)
        self._defaults(kind, obj)
        return self._commit(plural, "ADDED", None, obj)

    def _validate(self, kind: Kind, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if kind.plural == "pods":
            containers = (obj.get("spec") or {}).get("containers")
            if not containers:
                raise invalid(
                    "Pod", name, "spec.containers", "FieldValueRequired", "Required value"
                )
            for index, container in enumerate(containers):
                for key in ("name", "image"):
                    if not container.get(key):
                        raise invalid(
                            "Pod",
                            name,
                            f"spec.containers[{index}].{key}",
                            "FieldValueRequired",
                            "Required value",
                        )

    def _defaults(self, kind: Kind, obj: Obj) -> None:
        if kind.plural == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("dnsPolicy", "ClusterFirst")
            obj["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
        elif kind.plural == "secrets":
            obj.setdefault("type", "Opaque")
            _fold_string_data(obj)
        elif kind.plural == "namespaces":
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj.setdefault("status", {"phase": "Active"})

    def update(
        self,
        plural: str,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
    ) -> Obj:
        """Replace an object (``PUT``) or, with ``subresource="status"``, only its status."""
        kind = KINDS[plural]
        old = self.get(plural, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
        new: Obj = copy.deepcopy(body)
        new_meta = new.get("metadata") or {}
        if new_meta.get("name") not in (None, name):
            raise ApiError(
                400, "BadRequest", "the name of the object does not match the name on the URL"
            )
        wanted_rv = new_meta.get("resourceVersion")
        if wanted_rv not in (None, "") and str(wanted_rv) != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified;'
                " please apply your changes to the latest version and try again",
                {"name": name, "kind": plural},
            )
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status") or {}
            new = merged
        else:
            if kind.has_status:
                new["status"] = copy.deepcopy(old.get("status"))
                if new["status"] is None:
                    del new["status"]
            meta = new.setdefault("metadata", {})
            for key in (
                "uid",
                "creationTimestamp",
                "namespace",
                "name",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
                else:
                    meta.pop(key, None)
            new["apiVersion"] = "v1"
            new["kind"] = kind.kind
            if plural == "pods":
                self._validate(kind, new)
            if plural == "secrets":
                _fold_string_data(new)
        return self._replace(plural, old, new)

    def _replace(self, plural: str, old: Obj, new: Obj) -> Obj:
        new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:  # a no-op update changes nothing, not even the version
            return old
        return self._commit(plural, "MODIFIED", old, new)

    def patch(
        self,
        plural: str,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
    ) -> Obj:
        old = self.get(plural, namespace, name)
        if "json-patch" in content_type:
            try:
                patched = jsonpatch.apply_patch(old, patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", f"the server rejected our request: {exc}") from exc
        elif "merge-patch" in content_type:
            if not isinstance(patch, dict):
                raise ApiError(
                    400, "BadRequest", "the body of the request was in an unknown format"
                )
            patched = semantics.merge_patch(old, patch)
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include:"
                f" application/json-patch+json, application/merge-patch+json,"
                f" application/strategic-merge-patch+json; got {content_type!r}",
            )
        return self.update(plural, namespace, name, patched, subresource=subresource)

    def mutate(
        self, plural: str, namespace: str | None, name: str, change: Callable[[Obj], None]
    ) -> Obj | None:
        """Change an object in place, as a controller's update would; ``None`` if it is gone."""
        old = self.find(plural, namespace, name)
        if old is None:
            return None
        new = copy.deepcopy(old)
        change(new)
        return self._replace(plural, old, new)

    def delete(
        self,
        plural: str,
        namespace: str | None,
        name: str,
        grace: int | None = None,
        preconditions: Mapping[str, Any] | None = None,
    ) -> Obj:
        obj = self.get(plural, namespace, name)
        meta = obj["metadata"]
        for key, field_name in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = (preconditions or {}).get(key)
            if wanted is not None and str(wanted) != str(meta.get(key)):
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": Precondition failed:'
                    f" {field_name} in precondition: {wanted}, {field_name} in object meta:"
                    f" {meta.get(key)}",
                    {"name": name, "kind": plural},
                )
        if plural == "pods":
            spec = obj.get("spec") or {}
            phase = (obj.get("status") or {}).get("phase")
            if grace is None:
                grace = int(spec.get("terminationGracePeriodSeconds", 30))
            graceful = bool(spec.get("nodeName")) and phase not in ("Succeeded", "Failed")
            if graceful and grace > 0:
                current = meta.get("deletionGracePeriodSeconds")
                if current is not None and int(current) <= grace:
                    return obj  # already being deleted at least as fast
                when = semantics.now() + datetime.timedelta(seconds=grace)

                def mark(pod: Obj) -> None:
                    pod["metadata"]["deletionTimestamp"] = semantics.timestamp(when)
                    pod["metadata"]["deletionGracePeriodSeconds"] = grace

                marked = self.mutate(plural, namespace, name, mark)
                assert marked is not None
                return marked
        return self.remove(plural, namespace, name) or obj

    def remove(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        """Remove an object now (``DELETED``), then its dependents and a namespace's content."""
        obj = self.find(plural, namespace, name)
        if obj is None:
            return None
        gone = self._commit(plural, "DELETED", obj, obj)
        if plural == "namespaces":
            for other, kind in KINDS.items():
                if kind.namespaced:
                    for ns, dependent in list(self.objects[other]):
                        if ns == name:
                            with contextlib.suppress(ApiError):
                                self.delete(other, ns, dependent)
        self.collect_garbage()
        return gone

    def collect_garbage(self) -> None:
        """Delete every object whose owners (by uid) are all gone."""
        uids = {
            obj["metadata"]["uid"] for objects in self.objects.values() for obj in objects.values()
        }
        for plural, objects in self.objects.items():
            for (ns, name), obj in list(objects.items()):
                owners = [ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []]
                if owners and not any(uid in uids for uid in owners):
                    if obj["metadata"].get("deletionTimestamp"):
                        continue
                    with contextlib.suppress(ApiError):
                        self.delete(plural, ns or None, name)

    # -- watching -----------------------------------------------------------------------------

    def expire_watches(self) -> None:
        """End every open watch; resuming from the current version or earlier gets 410."""
        self.expired = self.rv
        self.rv += 1  # so that a relist gets a version a watch can resume from
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)

    def close_watches(self) -> None:
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)

    def subscribe(self, watcher: Watcher, since: str | None) -> list[Obj]:
        """Register a watch; return the events it starts with (raise 410 if it is too old)."""
        if since in (None, "", "0"):
            events = [
                {"type": "ADDED", "object": obj}
                for obj in self.all(watcher.plural)
                if watcher.selects(obj)
            ]
        else:
            try:
                rv = int(str(since))
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid resource version: {since}") from exc
            if rv <= self.expired or rv < self.floor:
                raise expired(rv, self.rv)
            events = []
            for change in self.history:
                if change.rv > rv:
                    event = watcher.event(change)
                    if event is not None:
                        events.append(copy.deepcopy(event))
        self.watchers.add(watcher)
        return events

    # -- permissions --------------------------------------------------------------------------

    def check(self, verb: str, resource: str, namespace: str | None, name: str | None) -> None:
        if (verb, resource) not in self.forbidden:
            return
        subject = f'{resource} "{name}"' if name else resource
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        raise ApiError(
            403,
            "Forbidden",
            f'{subject} is forbidden: User "{USER}" cannot {verb} resource "{resource}"'
            f' in API group "" {scope}',
            {"name": name, "kind": resource.split("/")[0]} if name else {"kind": resource},
        )
