"""The agent's side of the master API: typed requests over the agent's channel
(:mod:`planaria.agent.channel`), retries while the master is unreachable, re-attaching to a
restarted master, and a clear error once the master has been gone for longer than the grace.

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

from planaria.agent.channel import Channel, ChannelRefused
from planaria.errors import PlanariaError
from planaria.log import get_logger
from planaria.protocol import FINGERPRINT_ENV

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
        self.reattach: Callable[[], Awaitable[None]] | None = None
        self._unreachable_since: float | None = None
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        self.channel = Channel(self._session, self.url, True if self._ssl is None else self._ssl)

    @property
    def read_timeout(self) -> float:
        """The longest the master may keep silent: a master cut off by the network sends
        nothing, and only the channel's pings notice (its requests are then tried again, within
        the grace)."""
        return self.channel.ping * 1.5

    @read_timeout.setter
    def read_timeout(self, seconds: float) -> None:
        self.channel.ping = seconds / 1.5

    async def call(self, path: str, body: BaseModel, reply: type[R]) -> R:
        """Ask the master ``path`` (a node route, such as ``/heartbeat``) with ``body``: its
        reply, once the master answers (through outages within the grace). A try that the
        channel lost is sent again under its sequence number (the master serves it once); a
        try the master answered "not now" (re-attach first, not yet) is a new request."""
        ticket = [self.channel.number()]  # the try's sequence number
        try:
            return await self._call(ticket, path, body.model_dump_json(), reply)
        finally:
            self.channel.done(ticket[0])

    async def tell(self, path: str, body: BaseModel) -> bool:
        """Tell the master ``path`` (a route that takes notices: ``/heartbeat``) with ``body``,
        wanting no reply: False when there was no channel to send it on. A notice is what the
        next one says again, so it is not retried; the agent's requests ride out the outage."""
        try:
            await self.channel.tell(path, body.model_dump_json())
        except (ChannelRefused, aiohttp.ServerFingerprintMismatch) as exc:
            raise self._refused(exc) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("a notice not sent", path=path, error=str(exc) or type(exc).__name__)
            return False
        return True

    def _refused(self, exc: ChannelRefused | aiohttp.ServerFingerprintMismatch) -> MasterRejected:
        if isinstance(exc, ChannelRefused):
            return MasterRejected(
                f"the master at {self.url} refused this agent's channel ({exc.status}): "
                f"{exc} (a wrong token, or a master of an older planaria)"
            )
        return MasterRejected(
            f"the server at {self.url} is not this job's master: its certificate's "
            f"SHA-256 is {exc.got.hex()[:16]}..., the job's is "
            f"{exc.expected.hex()[:16]}... ({FINGERPRINT_ENV})"
        )

    async def _call(self, ticket: list[int], path: str, body: str, reply: type[R]) -> R:
        delay = 0.05
        asked = time.monotonic()
        while True:
            try:
                status, answer = await self.channel.ask(ticket[0], path, body)
                self._reached()
                if status in (409, 503):  # answered: a try again is a new request
                    self.channel.done(ticket[0])
                    ticket[0] = self.channel.number()
                text = answer.get("error", "") if isinstance(answer, dict) else ""
                text = text or str(answer)
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
                return reply.model_validate(answer)
            except (ChannelRefused, aiohttp.ServerFingerprintMismatch) as exc:
                raise self._refused(exc) from None
            except _NotYet as exc:  # it answers: only not yet what we asked
                if time.monotonic() - asked > max(self.give_up_after, NOT_YET_PATIENCE):
                    raise MasterUnreachable(f"master at {self.url} kept saying {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self._unreached(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)

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
        await self.channel.close()
        await self._session.close()
