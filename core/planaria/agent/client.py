"""The agent's side of the master API: typed requests, retries while the master is briefly
unreachable, and a clear error once it has been gone for longer than the heartbeat timeout."""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

import aiohttp
from pydantic import BaseModel

from planaria.errors import PlanariaError
from planaria.protocol import API_PREFIX

R = TypeVar("R", bound=BaseModel)


class MasterUnreachable(PlanariaError):
    """The master did not answer for longer than the heartbeat timeout."""


class MasterRejected(PlanariaError):
    """The master answered with an error (bad token, bad request, unknown node)."""


class _NotYet(Exception):
    """The master answered 503: it cannot say yet (e.g. this node's launch is in flight)."""


class MasterClient:
    def __init__(self, url: str, token: str, give_up_after: float = 15.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.give_up_after = give_up_after
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    async def call(self, path: str, body: BaseModel | None, reply: type[R]) -> R:
        deadline = time.monotonic() + self.give_up_after
        delay = 0.05
        while True:
            try:
                if body is None:
                    request = self._session.get(f"{self.url}{API_PREFIX}{path}")
                else:
                    request = self._session.post(
                        f"{self.url}{API_PREFIX}{path}",
                        data=body.model_dump_json(),
                        headers={"Content-Type": "application/json"},
                    )
                async with request as response:
                    text = await response.text()
                    if response.status == 503:
                        raise _NotYet(text)
                    if response.status != 200:
                        raise MasterRejected(f"master answered {response.status} to {path}: {text}")
                    return reply.model_validate_json(text)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _NotYet) as exc:
                if time.monotonic() > deadline:
                    raise MasterUnreachable(
                        f"master at {self.url} unreachable for {self.give_up_after:g}s: {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        await self._session.close()
