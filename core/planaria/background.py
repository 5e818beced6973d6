"""Work started in the background and kept until it is done.

The event loop holds only a weak reference to a task: one nobody keeps may be collected while it
runs. :class:`Running` keeps each future it is given until it is done, and lists those still
running for whoever must wait for them or cancel them (a close).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=asyncio.Future[Any] | concurrent.futures.Future[Any])


class Running(Generic[F]):
    """The futures started and not yet done."""

    def __init__(self) -> None:
        self._futures: set[F] = set()

    def keep(self, future: F) -> F:
        """Keep ``future`` until it is done (done callbacks of a thread's future run in the
        thread that finishes it: a set's add and discard are each one atomic step)."""
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return future

    def start(self: Running[asyncio.Future[Any]], work: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``work`` on the running loop, kept until it is done."""
        return self.keep(asyncio.ensure_future(work))

    def __iter__(self) -> Iterator[F]:
        return iter(list(self._futures))

    def __len__(self) -> int:
        return len(self._futures)
