"""The agent's side of the master API: typed requests, retries while the master is
unreachable, re-attaching to a restarted master, and a clear error once the master has been
gone for longer than the grace.

Over ``https`` the agent trusts one certificate only, the job's, by its SHA-256 fingerprint:
no certificate authority is consulted, and a server that shows another certificate is refused
at once (it is not the master, however long one waits)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlparse

import aiohttp
from pydantic import BaseModel

from planaria.errors import PlanariaError
from planaria.log import get_logger
from planaria.protocol import API_PREFIX, FINGERPRINT_ENV

R = TypeVar("R", bound=BaseModel)

log = get_logger("agent")

MAX_DELAY = 1.0
"""The longest wait between two tries: a restarted master hears from every agent soon."""
NOT_YET_PATIENCE = 1800.0
"""How long an agent keeps asking while the master answers "not yet" (503: its node's launch is
in flight). The master is there and says so; its launch is what bounds the wait: a scheduler
that returns once every node runs (kubernetes, until images are pulled: its
``start_timeout``) keeps the first agents waiting that long."""


class MasterUnreachable(PlanariaError):
    """The master did not answer for longer than the grace."""


class MasterRejected(PlanariaError):
    """The master answered with an error (bad token, bad request, unknown node)."""


class FencedOut(MasterRejected):
    """The master declared this node lost: its workers must stop."""


class _NotYet(Exception):
    """The master answered 503: it cannot say yet (e.g. this node's launch is in flight)."""


def _pin(url: str, fingerprint: str | None) -> aiohttp.Fingerprint | None:
    scheme = urlparse(url).scheme
    if scheme not in ("http", "https"):
        raise PlanariaError(f"the master's URL {url!r} is neither http:// nor https://")
    if fingerprint is None:
        if scheme == "https":
            raise PlanariaError(
                f"the master at {url} speaks TLS but no fingerprint of its certificate was "
                f"given ({FINGERPRINT_ENV}): its certificate cannot be trusted blindly"
            )
        return None
    if scheme != "https":
        raise PlanariaError(
            f"a certificate fingerprint was given for {url}, which is not https: the "
            "connection would not be encrypted"
        )
    try:
        raw = bytes.fromhex(fingerprint)
        return aiohttp.Fingerprint(raw)
    except ValueError:
        raise PlanariaError(
            f"the master's fingerprint ({FINGERPRINT_ENV}) must be the 64 hex digits of a "
            f"SHA-256, got {len(fingerprint)} characters"
        ) from None


class MasterClient:
    """``give_up_after``: how long the master may be unreachable (counted from the first
    failure, across calls) before a call raises :class:`MasterUnreachable`. ``reattach``:
    called when the master asks this node to re-attach (a restarted master), before the
    request is tried again."""

    def __init__(
        self,
        url: str,
        token: str,
        give_up_after: float = 15.0,
        fingerprint: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.give_up_after = give_up_after
        self._ssl = _pin(self.url, fingerprint)
        self.read_timeout: float | None = None
        """The longest a reply may keep silent: a master cut off by the network sends
        nothing, and only this ends the request (then tried again, within the grace)."""
        self.reattach: Callable[[], Awaitable[None]] | None = None
        self._unreachable_since: float | None = None
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    async def call(self, path: str, body: BaseModel | None, reply: type[R]) -> R:
        delay = 0.05
        asked = time.monotonic()
        while True:
            try:
                status, text = await self._request(path, body)
                self._reached()
                if status == 409 and self.reattach is not None and path != "/reattach":
                    log.info("the master asks this node to re-attach")
                    await self.reattach()
                    continue
                if status == 410:
                    raise FencedOut(f"the master fenced this node out of the job: {text}")
                if status == 503:
                    raise _NotYet(text)
                if status != 200:
                    raise MasterRejected(f"master answered {status} to {path}: {text}")
                return reply.model_validate_json(text)
            except aiohttp.ServerFingerprintMismatch as exc:
                raise MasterRejected(
                    f"the server at {self.url} is not this job's master: its certificate's "
                    f"SHA-256 is {exc.got.hex()[:16]}..., the job's is "
                    f"{exc.expected.hex()[:16]}... ({FINGERPRINT_ENV})"
                ) from None
            except _NotYet as exc:  # it answers: only not yet what we asked
                if time.monotonic() - asked > max(self.give_up_after, NOT_YET_PATIENCE):
                    raise MasterUnreachable(f"master at {self.url} kept saying {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self._unreached(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)

    async def _request(self, path: str, body: BaseModel | None) -> tuple[int, str]:
        ssl = True if self._ssl is None else self._ssl
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.read_timeout)
        if body is None:
            request = self._session.get(f"{self.url}{API_PREFIX}{path}", ssl=ssl, timeout=timeout)
        else:
            request = self._session.post(
                f"{self.url}{API_PREFIX}{path}",
                data=body.model_dump_json(),
                headers={"Content-Type": "application/json"},
                ssl=ssl,
                timeout=timeout,
            )
        async with request as response:
            return response.status, await response.text()

    def _reached(self) -> None:
        if self._unreachable_since is not None:
            gone = time.monotonic() - self._unreachable_since
            log.info("the master answers again", after_s=round(gone, 3))
            self._unreachable_since = None

    def _unreached(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
            log.warning(
                "the master is unreachable; workers keep training meanwhile",
                error=str(exc) or type(exc).__name__,
                grace_s=self.give_up_after,
            )
        elif now - self._unreachable_since > self.give_up_after:
            raise MasterUnreachable(
                f"master at {self.url} unreachable for {self.give_up_after:g}s: {exc}"
            ) from exc

    async def close(self) -> None:
        await self._session.close()
