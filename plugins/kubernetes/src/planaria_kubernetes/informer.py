"""List, then watch: the objects of one kind as the API server has them, with no change missed.

An :class:`Informer` lists the objects (of a label selector), then watches from the list's
``resourceVersion``. A watch that ends (its ``timeoutSeconds``, a dropped connection) is
resumed from the last version seen; one the API server answers with 410 Gone (the version is
older than what it keeps) is followed by a fresh list, compared with what was known, so that
an object that changed or went away meanwhile is reported all the same. Objects are kept as
the API server's JSON (no model conversion on this hot path).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

from planaria.log import get_logger

log = get_logger("scheduler.kubernetes")

Change = Callable[[str, "dict[str, Any] | None", "dict[str, Any] | None"], None]
"""``(name, before, after)``: after is None when the object is gone, before when it is new."""


class Expired(Exception):
    """The API server no longer has the version a watch resumed from (410 Gone)."""


class Informer:
    def __init__(
        self,
        what: str,
        list_call: Callable[..., Any],
        on_change: Change,
        *,
        selector: str | None = None,
        watch_timeout: int = 60,
        request_timeout: float = 20.0,
    ) -> None:
        self.what = what
        self._list_call = list_call
        self._on_change = on_change
        self._selector = selector
        self._watch_timeout = watch_timeout
        self._request_timeout = request_timeout
        self.objects: dict[str, dict[str, Any]] = {}
        self.synced = threading.Event()
        """Set once the first list came back."""
        self.relists = 0
        """Lists after a 410 Gone."""
        self.error = ""
        """The last failure of a list or watch, until one succeeds again."""
        self._stopping = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{what}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:  # unblocks the read the watch waits in
            with contextlib.suppress(Exception):
                getattr(response, "shutdown", response.close)()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._request_timeout + 5)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                version = self._list()
                self.error = ""
                backoff = 0.2
                while not self._stopping.is_set():
                    version = self._watch(version)
            except Expired as exc:
                self.relists += 1
                log.info("watch expired; listing again", what=self.what, said=str(exc))
            except Exception as exc:  # a dropped connection, an API error: try again
                if self._stopping.is_set():
                    break
                self.error = " ".join(str(exc).split())[:300]
                log.warning("watch failed; trying again", what=self.what, error=self.error)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"_preload_content": False}
        if self._selector:
            args["label_selector"] = self._selector
        return args

    def _list(self) -> str:
        response = self._list_call(**self._args(), _request_timeout=self._request_timeout)
        try:
            listing = json.loads(response.data)
        finally:
            response.release_conn()
        now = {item["metadata"]["name"]: item for item in listing.get("items") or []}
        before = self.objects
        self.objects = dict(now)
        for name, gone in before.items():
            if name not in now:
                self._on_change(name, gone, None)
        for name, item in now.items():
            old = before.get(name)
            if old is None or _version(old) != _version(item):
                self._on_change(name, old, item)
        self.synced.set()
        return str(listing.get("metadata", {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        from kubernetes.watch.watch import iter_resp_lines

        response = self._list_call(
            **self._args(),
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout,
            _request_timeout=(self._request_timeout, self._watch_timeout + self._request_timeout),
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self._stopping.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, item = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if item.get("code") == 410:
                        raise Expired(item.get("message") or "410 Gone")
                    raise RuntimeError(f"watch error {item.get('code')}: {item.get('message')}")
                version = _version(item) or version
                if kind == "BOOKMARK":
                    continue
                name = item.get("metadata", {}).get("name")
                if not name:
                    continue
                old = self.objects.get(name)
                if kind == "DELETED":
                    self.objects.pop(name, None)
                    self._on_change(name, old, None)
                else:
                    self.objects[name] = item
                    self._on_change(name, old, item)
        finally:
            self._response = None
            with contextlib.suppress(Exception):
                response.release_conn()
        return version


def _version(item: dict[str, Any]) -> str:
    return str(item.get("metadata", {}).get("resourceVersion") or "")
