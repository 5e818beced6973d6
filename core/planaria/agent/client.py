"""The agent's side of the master API: typed requests, retries while the master is briefly
unreachable, and a clear error once it has been gone for longer than the heartbeat timeout.

Over ``https`` the agent trusts one certificate only, the job's, by its SHA-256 fingerprint:
no certificate authority is consulted, and a server that shows another certificate is refused
at once (it is not the master, however long one waits)."""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar
from urllib.parse import urlparse

import aiohttp
from pydantic import BaseModel

from planaria.errors import PlanariaError
from planaria.protocol import API_PREFIX, FINGERPRINT_ENV

R = TypeVar("R", bound=BaseModel)


class MasterUnreachable(PlanariaError):
    """The master did not answer for longer than the heartbeat timeout."""


class MasterRejected(PlanariaError):
    """The master answered with an error (bad token, bad request, unknown node)."""


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
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    async def call(self, path: str, body: BaseModel | None, reply: type[R]) -> R:
        deadline = time.monotonic() + self.give_up_after
        delay = 0.05
        while True:
            try:
                ssl = True if self._ssl is None else self._ssl
                if body is None:
                    request = self._session.get(f"{self.url}{API_PREFIX}{path}", ssl=ssl)
                else:
                    request = self._session.post(
                        f"{self.url}{API_PREFIX}{path}",
                        data=body.model_dump_json(),
                        headers={"Content-Type": "application/json"},
                        ssl=ssl,
                    )
                async with request as response:
                    text = await response.text()
                    if response.status == 503:
                        raise _NotYet(text)
                    if response.status != 200:
                        raise MasterRejected(f"master answered {response.status} to {path}: {text}")
                    return reply.model_validate_json(text)
            except aiohttp.ServerFingerprintMismatch as exc:
                raise MasterRejected(
                    f"the server at {self.url} is not this job's master: its certificate's "
                    f"SHA-256 is {exc.got.hex()[:16]}..., the job's is "
                    f"{exc.expected.hex()[:16]}... ({FINGERPRINT_ENV})"
                ) from None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _NotYet) as exc:
                if time.monotonic() > deadline:
                    raise MasterUnreachable(
                        f"master at {self.url} unreachable for {self.give_up_after:g}s: {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        await self._session.close()
